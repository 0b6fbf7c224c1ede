"""The benchmark scripts run end to end on the CPU with tiny sizes (their numbers mean nothing here;
the GPU session runs them for real), so a broken script is caught before device time. A script
runs in the test's own process (`_run`: runpy, as `__main__`; checkout_ab.py and planner_speed.py
start their fresh processes from there), the pytest-benchmark file as a pytest command, and the
torchrun ones their command line (`cli()`) as jobs of the suite's launches."""
import os
import runpy
import subprocess
import sys

from tests.harness.in_this_process import run_here

from tests.launches import Job, needs

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(script: str, *args: str) -> str:
    """The script as `python benchmarks/SCRIPT ARGS` runs it, in this process (runpy, as __main__,
    its folder first on sys.path: tests/harness/in_this_process.py): what it printed; a non-zero
    exit fails the test with its output."""
    folder = os.path.join(ROOT, "benchmarks")
    proc = run_here(lambda: runpy.run_path(os.path.join(folder, script), run_name="__main__"), [script, *args],
                    path=folder)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_kernel_benchmark_times_each_case_forward_and_backward_and_checks_agreement():
    out = _run("kernels.py", "--quick", "--no-compile", "--cases", "bias_gelu_tanh", "layer_norm", "softmax_mask")
    rows = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith("| ") and "kernel" not in line]
    cells = [[c.strip() for c in r] for r in rows]
    assert [(r[0], r[2]) for r in cells] == [(c, p) for c in ("bias_gelu_tanh", "layer_norm", "softmax_mask")
                                            for p in ("fwd", "fwd+bwd")]
    agree = {r[0]: r[11] for r in cells}
    assert agree["bias_gelu_tanh"].startswith("ok") and agree["layer_norm"].startswith("ok")
    assert agree["softmax_mask"] == "n/a"          # fully masked rows: 0 fused, NaN in torch.softmax
    assert all(float(r[4]) > 0 and float(r[7]) > 0 for r in cells) and "copy bandwidth measured" in out


def test_self_check_cost_benchmark_checks_every_op():
    from autoshard.kernels.cpu_executor import compiler
    out = _run("self_check_cost.py", "--dtypes", "fp32")
    assert ("checks on" in out and "FAIL" not in out) or (compiler() is None and "nothing to measure" in out)


def test_mfu_benchmark_runs_every_program():
    out = _run("mfu.py", "--quick", "--steps", "2", "--warmup", "1", "--fused", "--fp8")
    assert "| autoshard " in out and "| plain" in out and "| autoshard fused" in out and "| autoshard fp8" in out, out
    assert "step time against plain: autoshard " in out and ", autoshard fused " in out, out
    assert "; fp8 / bf16 step " in out, out


def test_launch_overhead_benchmark_times_every_op():
    out = _run("launch_overhead.py", "--calls", "3")
    from autoshard.testing.kernel_cases import CASES
    assert all(f"| {name} " in out for name in CASES) and "Most host time per fused call" in out, out


def test_launch_overhead_with_a_noop_launch_takes_the_kernel_path():
    """--noop-launch: every op's forward and backward reach the launch (the CUDA path's host work),
    none falls back to its torch implementation."""
    from autoshard.kernels.launch import LAUNCHES
    before = dict(LAUNCHES)
    out = _run("launch_overhead.py", "--calls", "3", "--noop-launch")
    assert "cpu, the CUDA path with a no-op launch, torch.bfloat16" in out, out
    launched = {name for name, n in LAUNCHES.items() if n > before.get(name, 0)}
    assert len(launched) >= 10 and any("bwd" in name or "backward" in name for name in launched), launched


def test_launch_layers_benchmark_times_each_layer_of_the_call_path():
    from autoshard.kernels.cpu_executor import compiler
    out = _run("launch_layers.py", "--calls", "3")
    if compiler() is None:
        assert "nothing to measure" in out
        return
    rows = [line for line in out.splitlines() if line.startswith("| ") and "host us/call" not in line]
    assert len(rows) == 15 and all(float(r.split("|")[3]) > 0 for r in rows), out
    assert "the norm op" in out and "against eager layer_norm's" in out, out


def test_checkout_comparison_runs_each_side_from_its_own_checkout(tmp_path):
    out = _run("checkout_ab.py", ROOT, ROOT, "--quick")
    row = next(line for line in out.splitlines() if line.startswith("| gpt2 tp=2"))
    cells = [c.strip() for c in row.split("|")[1:-1]]
    assert len(cells) == 7 and all(float(c) > 0 for c in cells[1:])
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "checkout_ab.py"), str(tmp_path), ROOT,
                           "--quick"], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode != 0 and f"{tmp_path}: imported autoshard from" in proc.stderr


def test_planner_speed_times_a_search_from_each_checkout(tmp_path):
    out = _run("planner_speed.py", "--quick")                  # this checkout alone: one process
    row = next(line for line in out.splitlines() if line.startswith("| gpt2-xl"))
    cells = [c.strip() for c in row.split("|")[1:-1]]
    assert len(cells) == 3 and int(cells[1]) > 0 and float(cells[2]) > 0, out
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "planner_speed.py"), str(tmp_path), "--quick"],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode != 0 and f"{tmp_path}: imported autoshard from" in proc.stderr


# the scripts' command lines (cli()) as jobs of the suite's world-2 launch (tests/launches.py)
PIPELINE_OVERHEAD = Job("benchmarks/pipeline-overhead", "benchmarks.pipeline_overhead:cli",
                        ("--layers", "4", "--hidden", "64", "--vocab", "256", "--seq", "32", "--rounds", "2",
                         "--warmup", "0"), 2, local=False)     # timings of real processes
EXPERT_PARALLEL = Job("benchmarks/expert-parallel", "benchmarks.expert_parallel:cli",
                      ("--layers", "2", "--hidden", "64", "--ffn", "64", "--vocab", "256", "--seq", "32", "--rounds",
                       "2", "--warmup", "0"), 2, local=False)


@needs(PIPELINE_OVERHEAD)
def test_pipeline_overhead_benchmark_runs_all_four_programs_on_the_same_losses(launched):
    """autoshard's 1F1B and interleaved against torch.distributed.pipelining's, tiny sizes: the four
    programs agree on the losses before anything is timed, and each step's ops and sends are counted."""
    result = launched(PIPELINE_OVERHEAD)[0]
    assert result["all_ranks_ok"] and result["loss_rel"] <= 1e-5
    names = ("autoshard 1f1b", "autoshard interleaved", "torch 1f1b", "torch interleaved")
    assert all(result["ops"][n] > 0 and result["sends"][n] > 0 and result["cpu_ms"][n] > 0 for n in names)


@needs(EXPERT_PARALLEL)
def test_expert_parallel_benchmark_runs_both_programs(launched):
    """Replicated experts against ep=2 at tiny sizes: both rows, the experts' memory per rank halved
    (8 experts, 4 a rank) and all-to-all bytes only where the experts are divided."""
    (result,) = launched(EXPERT_PARALLEL)
    full, divided = result["rows"]["replicated (ep=1)"], result["rows"]["divided over ep=2"]
    assert result["all_ranks_ok"]
    assert divided["experts_mib"] == full["experts_mib"] / 2 and full["all_to_all_mib"] == 0 < divided["all_to_all_mib"]


FULLY_SHARDED = Job("benchmarks/fully-sharded", "benchmarks.fully_sharded:cli",
                    ("--layers", "2", "--hidden", "64", "--vocab", "256", "--seq", "32", "--rounds", "1",
                     "--peak-steps", "1", "--ours", "autoshard zero=3", "--dp", "2"), 2,
                    local=False)      # torch's FSDP2 beside ours: real processes (the world-2 launch's)


@needs(FULLY_SHARDED)
def test_fully_sharded_benchmark_runs_ours_and_torchs_on_the_same_losses(launched):
    """zero=3 and FSDP2 at tiny sizes: the same losses; between steps zero=3 holds 16 bytes a
    parameter / dp (padding and the rotary table aside) and predicts its own peak."""
    (result,) = launched(FULLY_SHARDED)
    assert result["agree"] <= 1e-5
    for rank in result["ranks"]:
        z3 = rank["autoshard zero=3"]
        assert abs(z3["held"] - 16 * result["params"] / 2) <= 0.02 * z3["held"], (rank, result["params"])
        assert abs(z3["predicted"] / z3["peak"] - 1) < 0.05 and rank["torch FSDP2"]["step_s"] > 0, rank


def test_single_process_pytest_benchmarks_run_and_check_what_they_time():
    """benchmarks/bench_single_process.py once per body (--benchmark-disable): each pair runs and its
    own checks pass (the simulated loss equals the model's); the CUDA kernels skip here."""
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           os.path.join(ROOT, "benchmarks", "bench_single_process.py"), "-o", "python_files=bench_*.py",
                           "--benchmark-disable"], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0 and "4 passed" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
