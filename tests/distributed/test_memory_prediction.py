"""Memory predictions against measured peaks of real gloo runs: the GPT table (memory_model.py) within
15%, the rank's own graphs (graph_memory.py) within 0.1% on the GPT and 5% on other families
(benchmarks/planner_sweep.py and graph_memory_sweep.py run the whole sweeps)."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from autoshard.cpu_profile import CPU_DEFAULTS  # noqa: E402
from autoshard.planning.hardware import Hardware  # noqa: E402
from benchmarks.planner_sweep import predicted_memory, worker_args  # noqa: E402
from tests.launches import Job, job_params  # noqa: E402

# the byte counts are all the memory model reads of a profile; the rates are not used
CPU = Hardware("cpu", peak_tflops=0.1, hbm_gb_s=1, memory_gib=24, gpus_per_node=2, nvlink_gb_s=1,
               network_gb_s=1, **CPU_DEFAULTS)


CONFIGS = {"tp2-none": (2, 1, 1, 1, 1, "none", False), "pp2-m4-selective": (1, 2, 1, 1, 4, "selective", False),
           # zero-bubble: a chunk held from F to W, with B's gradients for W from B to W; zbv's rank 0
           # holds the first and the last stage
           "pp2-m4-zb-h1": (1, 2, 1, 1, 4, "none", False, "zb-h1"), "pp2-m4-zbv": (1, 2, 1, 2, 4, "none", False, "zbv"),
           # V-Half's rank 0 measured 20% over the model while a split B's outputs (and with them its
           # microbatch's graph) outlived the step's W until the next action rebound their names
           "pp2-m4-v-half": (1, 2, 1, 2, 4, "none", False, "v-half")}
# each configuration a job of the suite's launch of two processes (tests/launches.py)
JOBS = {name: Job(f"memory/{name}", "benchmarks.sweep_worker", tuple(worker_args(config) + ["--steps", "1"]), 2,
                  local=False)          # a process's own memory is what is measured
        for name, config in CONFIGS.items()}
# two other families, read off their graphs only: Llama with the distributed optimizer (zero 1 and 3); Mixtral's
# experts over ep = 2, whose measured routing is uneven where the prediction spreads it evenly
GRAPH_JOBS = {name: Job(f"memory/{name}", "benchmarks.sweep_worker", tuple(argv.split()), 2, local=False) for name, argv in {
    "llama-dp2-distributed-optimizer": "--model llama --dp 2 --distributed-optimizer --microbatches 2 --steps 1",
    # fully sharded: the walk gathers and releases each unit and makes its per-pass gradient as the step does
    "llama-dp2-zero3": "--model llama --dp 2 --zero 3 --microbatches 2 --steps 1",
    "mixtral-ep2": "--model mixtral --dp 2 --ep 2 --microbatches 2 --steps 1"}.items()}


@pytest.mark.slow
@pytest.mark.parametrize("name", job_params(JOBS))
def test_predicted_peak_memory_of_the_gpt_within_15_and_a_tenth_of_a_percent_of_measured(launched, name):
    config, ranks = CONFIGS[name], launched(JOBS[name])
    assert len(ranks) == 2
    for r in ranks:
        want = predicted_memory(config, r["pp_rank"], CPU).peak
        assert abs(want - r["peak_bytes"]) <= 0.15 * r["peak_bytes"], (r, want)
        # the walk posts each receive when the runtime on gloo does: one posted ahead and not walked
        # was 0.4-0.5% of a pipeline rank's peak (what is left here is under 0.03%)
        assert abs(r["graph_bytes"] - r["peak_bytes"]) <= 0.001 * r["peak_bytes"], r


@pytest.mark.slow
@pytest.mark.parametrize("name", job_params(GRAPH_JOBS))
def test_memory_read_off_the_graphs_within_5_percent_of_measured(launched, name):
    ranks = launched(GRAPH_JOBS[name])
    assert len(ranks) == 2
    for r in ranks:
        assert abs(r["graph_bytes"] - r["peak_bytes"]) <= 0.05 * r["peak_bytes"], r


def test_measured_cpu_profile_plans_our_runs():
    """The profile is measured in spawned processes (this process's threads and denormal mode left
    alone) and plans like any hardware, searching recompute modes."""
    import torch

    from autoshard import plan
    from autoshard.cpu_profile import measure_cpu
    from autoshard.planning.planner import ModelShape
    threads = torch.get_num_threads()
    hw = measure_cpu(hidden=64, heads=4, seq=32, microbatch=2, rounds=1, pairs=1)     # what runs, not how well
    assert torch.get_num_threads() == threads
    for name in ("peak_tflops", "attention_tflops", "hbm_gb_s", "network_gb_s", "latency_us", "optimizer_s_per_param"):
        assert getattr(hw, name) > 0, (name, hw)
    assert hw.activation_bytes == 4 and hw.tile == (1, 1) and hw.cores >= 1
    assert [kind for kind, _ in hw.startup_us] == ["all_reduce", "reduce_scatter", "all_gather", "send"]
    assert all(us >= 1.0 for _, us in hw.startup_us)
    found = plan(ModelShape(hidden=64, layers=4, heads=4, vocab=128, seq=32), gpus=2, global_batch=8, hardware=hw)
    assert found and {e.recompute for e in found} == {"none", "selective", "full"}
    assert found[0].recompute == "none"                   # it fits: recomputing costs time for nothing
    assert "memory (pipeline rank" in found[0].explain()
