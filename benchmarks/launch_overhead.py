"""Host time per call of each fused op against the same function as eager torch ops, on inputs so
small that the device finishes each kernel long before the host issues the next: what a fused op
costs the CPU (custom-op dispatch and autograd, the first-use check's lookup, the arguments'
exchange, CuPy's launch).

    python benchmarks/launch_overhead.py [--calls 2000] [--append]      # on a CUDA GPU
    python benchmarks/launch_overhead.py --calls 50                      # CPU: checks the script
    python benchmarks/launch_overhead.py --profile layer_norm            # where one op's host time goes
    python benchmarks/launch_overhead.py --noop-launch [--profile OP]    # CPU: the CUDA path, no kernel

Why it exists: on the first GPU session (2026-11-27, H200) `autoshard train` on a 406M Llama ran
1.50x slower with the fused ops than without, though each fused kernel alone beat eager torch at
transformer sizes (benchmarks/kernels.py). A step whose host time exceeds its device time is
bound by the host: this measures each op's share of it. Time: the host clock over `--calls`
back-to-back calls between two synchronizations, median of 5 rounds, per call.
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import importlib.util
import pstats
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results import report  # noqa: E402
from tabulate import tabulate  # noqa: E402

from autoshard.testing.kernel_cases import CASES, make_inputs  # noqa: E402


def _kernel_bench():
    """benchmarks/kernels.py as a module (the repository's top-level kernels/ package owns the name)."""
    spec = importlib.util.spec_from_file_location("bench_kernels", Path(__file__).with_name("kernels.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@contextlib.contextmanager
def noop_launch() -> Iterator[None]:
    """CPU tensors through the path a CUDA call takes (the dispatch's table and slot checks, the
    custom op, autograd, the launch's argument packing) with the kernel launch itself a no-op: the
    CPU executor on, its `launch` replaced, the first-use check off. The outputs are then whatever
    the empty buffers held: only the time means anything."""
    from autoshard.kernels import cpu_executor
    real = cpu_executor.launch
    cpu_executor.launch = lambda name, dtype_name, grid, block, args: None
    try:
        with cpu_executor.enabled(self_check=False):
            yield
    finally:
        cpu_executor.launch = real


# --noop-launch: the smallest inputs every kernel takes (16-byte packs of bf16 rows): the CPU's eager
# ops then spend their time in dispatch, as a GPU's do at the quick shapes
TINY_SHAPES = {4: (1, 2, 8, 8), 2: (4, 64)}


def per_call_us(fn, device: torch.device, calls: int, rounds: int = 5) -> float:
    for _ in range(3):
        fn()                                        # warm-up: the build, the first-use check
    times = []
    for _ in range(rounds):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - t) / calls)
    return 1e6 * statistics.median(times)


def profile(op: str, device: torch.device, dtype: torch.dtype, calls: int, top: int = 30) -> None:
    """cProfile over `calls` fused forward + backward calls of `op`: the Python functions its host
    time goes to, most time in the function itself first (on the CPU: the torch implementations')."""
    if op not in CASES:
        raise SystemExit(f"--profile: no op {op!r}; ops: {', '.join(CASES)}")
    case, bench = CASES[op], _kernel_bench()
    shapes = TINY_SHAPES if device.type == "cpu" and dtype == torch.bfloat16 else bench.QUICK_SHAPES
    inputs = make_inputs(case, shapes[len(case.bench[0])], dtype, device, seed=0)
    with torch.no_grad():
        grad_out = torch.randn_like(case.fused(**inputs))
    run = bench.passes_of(case, case.fused, inputs, grad_out)["fwd+bwd"]
    per_call_us(run, device, 10, rounds=1)                # warm-up: the build, the first-use check
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        run()
    profiler.disable()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    print(f"{op} fwd+bwd, {calls} calls, {dtype} on {device}:")
    pstats.Stats(profiler).strip_dirs().sort_stats("tottime").print_stats(top)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    ap.add_argument("--append", action="store_true")
    ap.add_argument("--profile", metavar="OP", help="print one op's cProfile (fused fwd+bwd) instead of the table")
    ap.add_argument("--noop-launch", action="store_true", help="on the CPU: the fused ops through the CUDA path "
                    "(the CPU executor) with the launch a no-op, so the time is the host's alone; the inputs "
                    "are then tiny (TINY_SHAPES), so that the eager ops' time is theirs too")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.noop_launch and device.type == "cuda":
        raise SystemExit("--noop-launch times the host path on the CPU; on a GPU run without it")
    dtype = torch.bfloat16 if args.dtype == "bf16" and (device.type == "cuda" or args.noop_launch) else torch.float32
    with noop_launch() if args.noop_launch else contextlib.nullcontext():
        _measure(args, device, dtype)


def _measure(args, device: torch.device, dtype: torch.dtype) -> None:
    if args.profile:
        profile(args.profile, device, dtype, args.calls)
        return
    bench = _kernel_bench()
    shapes = TINY_SHAPES if args.noop_launch else bench.QUICK_SHAPES
    rows = []
    for name, case in CASES.items():
        inputs = make_inputs(case, shapes[len(case.bench[0])], dtype, device, seed=0)
        with torch.no_grad():
            grad_out = torch.randn_like(case.fused(**inputs))
        fused = bench.passes_of(case, case.fused, inputs, grad_out)
        eager = bench.passes_of(case, case.eager, inputs, grad_out)
        for pass_name in ("fwd", "fwd+bwd"):
            f_us = per_call_us(fused[pass_name], device, args.calls)
            e_us = per_call_us(eager[pass_name], device, args.calls)
            rows.append([name, pass_name, f_us, e_us, f_us / e_us])
    table = tabulate(rows, floatfmt=".1f", tablefmt="github",
                     headers=["op", "pass", "fused host us/call", "eager host us/call", "fused / eager"])
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else \
        "cpu, the CUDA path with a no-op launch" if args.noop_launch else "cpu (torch implementations)"
    worst = max(rows, key=lambda r: r[2])
    summary = (f"{where}, {dtype}; {args.calls} calls per round. Most host time per fused call: "
               f"{worst[0]} {worst[1]} {worst[2]:.0f} us ({worst[4]:.2f}x eager's)")
    report(table, summary, append=args.append and (device.type == "cuda" or args.noop_launch),
           title="Fused ops' host time per call",
           command=f"python benchmarks/launch_overhead.py --calls {args.calls} --dtype {args.dtype}"
                   + (" --noop-launch" if args.noop_launch else ""),
           what="median of 5 rounds, tiny inputs: the host's cost, not the kernels'")


if __name__ == "__main__":
    main()
