import atexit
import os
import shutil
import socket
import subprocess
import tempfile
import warnings

import pytest
import torch
import torch.distributed as dist

from autoshard.compile import trace_cache
from tests import launches

warnings.filterwarnings("ignore", message=".*bos_token_id.*")

# The suite compiles the same small models hundreds of times (in this process and in every rank it
# launches, which inherit the environment): torch.export's trace is reused within each process
# (autoshard/compile/trace_cache.py, tested in tests/simulation/test_trace_cache.py). Tests and
# benchmarks that time compilation turn it off.
os.environ.setdefault(trace_cache.ENV, "1")

# Measured cpu profiles (autoshard/cpu_profile/cache.py) go to a folder of this test process, not
# the user's cache: a test measures afresh, and leaves nothing behind in the home directory, nor in
# the temporary one (each pytest process, xdist workers included, removes its own folder as it exits;
# the ranks it launched have exited before it).
os.environ["AUTOSHARD_CACHE_DIR"] = tempfile.mkdtemp(prefix="autoshard-test-cache-")
atexit.register(shutil.rmtree, os.environ["AUTOSHARD_CACHE_DIR"], ignore_errors=True)

# One thread per test process: the models here are tiny (threads buy nothing), and pytest-xdist
# workers each running several OpenMP threads on a 2-core machine spend CPU spinning against each other.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def one_process_group():
    """A real gloo process group of one rank (the executor's tests in one process)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


# Each test's tier is the folder it lives in (unit/, simulation/, local/, distributed/, gpu/), unless it
# names another with a marker; a test of a CUDA device elsewhere (a `needs a CUDA GPU` skip, or a
# "cuda" parameter) is also marked gpu. `pytest -m unit` runs one tier; tests/README.md tells what
# each holds.
TIERS = ("unit", "simulation", "local", "distributed", "gpu")

# The fast tier (`./run test --fast`, i.e. `-m fast`): what a developer runs between changes, about two
# minutes on two cores. Every subsystem at least once: the unit tier without its subprocess launches,
# one simulation check per feature, and one real torchrun launch. A row is a node-id prefix; a row
# that matches nothing in a whole-suite collection is an error (a renamed test must be renamed here).
FAST_UNIT_EXCEPT = ("test_cli.py::test_installed_command", "test_cli.py::test_errors_are_one_line",
                    "test_train_inputs.py::test_an_error_on_the_ranks", "test_train_inputs.py::test_the_command_line",
                    "test_train_inputs.py::test_an_empty_data_file", "test_moe_cost.py::test_the_planner_searches",
                    "test_costmodel.py::test_planner_ranks_the_papers", "test_cpu_executor.py::test_every_kernel_case")
FAST = (
    "tests/unit/",
    "tests/unit/test_cpu_executor.py::test_every_kernel_case_matches_float64_on_the_cpu_executor[bias_gelu_tanh-torch.float32",
    "tests/simulation/test_equivalence.py::test_outputs_and_gradients_match[2-",         # sharding, rewrite
    "tests/simulation/test_equivalence.py::test_several_optimizer_steps_match[llama]",
    "tests/simulation/test_op_rules.py::",                                                # one op per rule
    "tests/simulation/test_current_models.py::test_current_models_shard_every_weight_megatron_splits[GptOss-2-1]",
    "tests/simulation/test_context_parallel.py::test_context_parallel_equals_one_device[llama-cp2-tp2]",
    "tests/simulation/test_context_parallel.py::test_ring_attention_equals_sdpa",
    "tests/simulation/test_context_parallel.py::test_load_balanced_pieces",
    "tests/simulation/test_vocab_parallel.py::test_tied_weight_is_sharded_once_and_stays_tied",
    "tests/simulation/test_sequence_parallel.py::test_norms_and_residuals_run_on_local_tokens",
    "tests/simulation/test_dropout_rng.py::test_masks_differ_across_ranks_inside_tp_regions",
    "tests/simulation/test_pipeline.py::test_executor_accumulates_microbatches",          # runtime, one rank
    "tests/simulation/test_pipeline.py::test_each_stage_holds_its_layers_and_the_ends",
    "tests/simulation/test_distributed_optimizer_one_rank.py::test_equals_plain_adamw",
    "tests/simulation/test_fuse.py::test_rules_are_a_table_a_new_row_is_a_new_fusion",
    "tests/simulation/test_recompute.py::test_recomputation_runs_in_backward",
    "tests/simulation/test_cached_tables.py::test_microbatches_share_one_table",
    "tests/simulation/test_checkpoint.py::test_checkpoint_writes_each_row_once_and_atomically",
    "tests/simulation/test_expert_parallel_program.py::test_simulate_runs_expert_parallelism_with_tensor_parallelism[2-mixtral]",
    "tests/simulation/test_real_inputs.py::test_microbatch_losses_average_per_token",
    "tests/simulation/test_shapes_and_capture.py::test_other_batch_and_sequence_sizes_reuse_the_graph",
    "tests/simulation/test_weights_and_modes.py::test_a_first_call_under_inference_mode",
    "tests/simulation/test_half_precision_programs.py::test_half_precision_program_matches_the_half_precision_model[llama-bf16-full]",
    "tests/distributed/test_distributed.py::test_training_matches_single_device[2-vocab-parallel-loss]",
    "tests/local/test_local_runtime.py::test_interleaved_tp2_pp2_dp2",                    # the runtime, 8 ranks
    "tests/local/test_local_runtime.py::test_a_schedule_that_receives_before",
)


def _is_fast(nodeid: str) -> bool:
    if nodeid.startswith("tests/unit/") and any(e in nodeid for e in FAST_UNIT_EXCEPT):
        return any(nodeid.startswith(row) for row in FAST[1:])
    return any(nodeid.startswith(row) for row in FAST)


@pytest.hookimpl(tryfirst=True)         # before -k / -m deselect anything
def pytest_collection_modifyitems(config, items):
    ids = [item.nodeid for item in items]
    folders_only = all("::" not in a and not a.endswith(".py") for a in config.args)   # no test picked by name
    if folders_only and {i.split("/")[1] for i in ids if i.count("/") >= 2} >= {"unit", "simulation", "distributed"}:
        stale = [row for row in FAST if not any(i.startswith(row) for i in ids)]
        if stale:
            raise pytest.UsageError(f"tests/conftest.py FAST rows match no test: {stale}")
    for item in items:
        if _is_fast(item.nodeid):
            item.add_marker(pytest.mark.fast)
        if not any(item.get_closest_marker(t) for t in TIERS):
            folder = item.path.parent.name
            if folder in TIERS:
                item.add_marker(getattr(pytest.mark, folder))
        needs_cuda = any(m.name == "skipif" and "CUDA" in str(m.kwargs.get("reason", ""))
                         for m in item.iter_markers())
        if needs_cuda or "cuda" in getattr(getattr(item, "callspec", None), "params", {}).values():
            item.add_marker(pytest.mark.gpu)


def pytest_configure(config):
    config.pluginmanager.register(launches, "launches")     # the `launched` fixture, and its job selection


# How many multi-process launches the run made (torchrun, and `autoshard train`, which launches its
# ranks itself): counted where they start, in this process, and said at the end of the run.
_LAUNCHES: list[str] = []
_popen_init = subprocess.Popen.__init__


def _counting_init(self, args, *rest, **kwargs):
    words = [str(a) for a in args] if isinstance(args, (list, tuple)) else str(args).split()
    if "torch.distributed.run" in words or "autoshard.train" in words or "train" in words[2:4]:
        _LAUNCHES.append(" ".join(words[:6]))
    _popen_init(self, args, *rest, **kwargs)


subprocess.Popen.__init__ = _counting_init


def pytest_sessionfinish(session):
    if hasattr(session.config, "workeroutput"):          # a pytest-xdist worker: tell the controller
        session.config.workeroutput["launches"] = list(_LAUNCHES)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    _LAUNCHES.extend(getattr(node, "workeroutput", {}).get("launches", []))


def pytest_terminal_summary(terminalreporter):
    if _LAUNCHES:
        terminalreporter.write_line(f"multi-process launches: {len(_LAUNCHES)} (torchrun and autoshard train)")
