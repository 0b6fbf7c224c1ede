"""Every benchmark in one go; each appends its dated table to benchmarks/RESULTS.md.

    ./run bench                 # or: .venv/bin/python benchmarks/run_all.py [--quick] [--no-append]

1. Step time, autoshard against the hand-parallel baseline (gloo, torchrun, one thread per
   process): tp=2, pp=2 and tp=2 x pp=2 (1F1B, 4 microbatches) on the same nanoGPT.
   Then pipeline overhead against torch.distributed.pipelining (pipeline_overhead.py): autoshard's
   1F1B and interleaved schedules and torch's Schedule1F1B / ScheduleInterleaved1F1B on one HF Llama.
2. Compile time against bare torch.export on meta-device models: GPT-2 width from 8 to 128 layers
   (tp=4); the 1T shape (hidden 25600, 160 heads) from 16 to 128 layers at tp=8, pp=8, v=2 and at
   128 layers with pp=64, v=2; GPT-3 175B (96 layers, hidden 12288, 96 heads) at tp=8, pp=8, v=2.
3. The kernels' first-use self-check cost (on the CPU executor without a GPU), and the single-process
   pairs as pytest-benchmark tests (bench_single_process.py: compile against torch.export, a
   simulated step against the model's, fused kernels against eager on CUDA).
4. The planner's memory and step-time predictions against our CPU gloo runs (planner_sweep.py), memory
   read off the graphs of three model families against measured runs (graph_memory_sweep.py), the
   planner's pick of a fixed job against its candidates measured (planner_choice.py), the
   planner's search time (planner_speed.py),
   and the activation bytes one layer saves per recompute mode (activation_memory.py, printed).
5. The distributed optimizer at dp=2 and 4, fp32 and bf16 weights: bytes per parameter per rank
   against the cost model's accounting, and step time with the gradient reduction overlapped or after backward.
6. Expert parallelism against replicated experts (expert_parallel.py): tokens/s and memory per rank
   of a Mixtral-style model at dp=2 (ep=2) and dp=4 (ep=4).
7. On a machine with CUDA only: the fused kernels against eager torch and torch.compile
   (benchmarks/kernels.py) and the single-GPU MFU run (benchmarks/mfu.py).

`--quick` runs tiny sizes (a smoke test of the scripts, not a measurement) and never appends.
Exit status: the first failing benchmark's.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
MODEL = ["--layers", "4", "--hidden", "512", "--heads", "8", "--vocab", "8192", "--seq", "256", "--batch", "8"]
TINY = ["--layers", "4", "--hidden", "64", "--heads", "4", "--vocab", "256", "--seq", "32", "--batch", "8",
        "--rounds", "2", "--warmup", "0"]
STEP_CONFIGS = [["--tp", "2"], ["--tp", "1", "--pp", "2", "--microbatches", "4"],
                ["--tp", "2", "--pp", "2", "--microbatches", "4"]]
T1 = ["--hidden", "25600", "--heads", "160", "--tp", "8"]
COMPILE_CONFIGS = [["--layers", "8", "16", "32", "64", "128", "--tp", "4"],
                   ["--layers", "16", "32", "64", "128", *T1, "--pp", "8", "--virtual", "2"],
                   ["--layers", "128", *T1, "--pp", "64", "--virtual", "2"],
                   ["--layers", "96", "--hidden", "12288", "--heads", "96", "--tp", "8", "--pp", "8", "--virtual", "2"]]
COMPILE_TINY = [["--layers", "2", "4", "--tp", "2"], ["--layers", "4", "--tp", "2", "--pp", "2", "--virtual", "2"]]


def _world(cfg: list[str]) -> int:
    def get(flag: str) -> int:
        return int(cfg[cfg.index(flag) + 1]) if flag in cfg else 1
    return get("--tp") * get("--pp")


def commands(quick: bool, append: bool) -> list[list[str]]:
    py, extra = sys.executable, (["--append"] if append and not quick else [])
    out = []
    for cfg in STEP_CONFIGS:
        out.append([py, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={_world(cfg)}",
                    str(HERE / "step_time.py"), *cfg, *(TINY if quick else MODEL + ["--rounds", "20"]), *extra])
    out.append([py, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(HERE / "pipeline_overhead.py"),
                *(["--layers", "4", "--hidden", "64", "--vocab", "256", "--seq", "32", "--rounds", "2", "--warmup", "0"]
                  if quick else ["--rounds", "20"]), *extra])
    for cfg in COMPILE_TINY if quick else COMPILE_CONFIGS:
        out.append([py, str(HERE / "compile_scaling.py"), *cfg, *extra])
    out.append([py, str(HERE / "self_check_cost.py"), *extra])
    # single-process pairs (compile, simulated step, kernels on CUDA) as pytest-benchmark tests
    out.append([py, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(HERE / "bench_single_process.py"),
                "-o", "python_files=bench_*.py", *(["--benchmark-disable"] if quick else [])])
    # the planner against our own runs (quick: two configurations), activation bytes per recompute mode
    out.append([py, str(HERE / "planner_sweep.py"), *(["--configs", "0", "2"] if quick else []), *extra])
    out.append([py, str(HERE / "graph_memory_sweep.py"), *(["--configs", "0", "11"] if quick else []), *extra])
    if not quick:
        out.append([py, str(HERE / "planner_choice.py"), *extra])
    out.append([py, str(HERE / "planner_speed.py"), *(["--quick"] if quick else []), *extra])
    if not quick:
        out.append([py, str(HERE / "activation_memory.py")])
    # the distributed optimizer: bytes per parameter against the accounting, overlap on and off
    for dp, dtype in [(2, "float32")] if quick else [(d, t) for d in (2, 4) for t in ("float32", "bfloat16")]:
        out.append([py, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={dp}",
                    str(HERE / "distributed_optimizer.py"), "--dp", str(dp), "--dtype", dtype,
                    *(["--layers", "2", "--hidden", "64", "--rounds", "2", "--warmup", "0"] if quick else ["--rounds", "15"]),
                    *extra])
    for dp in (2,) if quick else (2, 4):
        out.append([py, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={dp}",
                    str(HERE / "expert_parallel.py"), "--dp", str(dp), "--ep", str(dp),
                    *(["--layers", "2", "--hidden", "64", "--ffn", "64", "--vocab", "256", "--seq", "32", "--rounds", "2",
                       "--warmup", "0"] if quick else []), *extra])
    if _has_cuda():
        out.append([py, str(HERE / "kernels.py"), *(["--quick"] if quick else []), *extra])
        out.append([py, str(HERE / "mfu.py"), *(["--quick"] if quick else []), *extra])
    return out


def _has_cuda() -> bool:
    import torch
    return torch.cuda.is_available()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes, nothing appended")
    ap.add_argument("--no-append", dest="append", action="store_false", help="print only")
    args = ap.parse_args()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}         # several processes share the cores
    for cmd in commands(args.quick, args.append):
        print("$", " ".join(cmd), flush=True)
        rc = subprocess.call(cmd, env=env, cwd=HERE.parent)
        if rc:
            print(f"run_all: failed with exit status {rc}", file=sys.stderr)
            return rc
    if not _has_cuda():
        print("run_all: no CUDA device here; the GPU benchmarks (benchmarks/kernels.py, mfu.py) were not run")
    return 0


if __name__ == "__main__":
    sys.exit(main())
