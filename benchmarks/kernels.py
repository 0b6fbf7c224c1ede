"""Fused kernels against eager torch and torch.compile of the same function, per kernel and size.

    python benchmarks/kernels.py [--dtype bf16] [--append]             # on a CUDA GPU
    python benchmarks/kernels.py --quick [--no-compile]                # tiny sizes; checks the script

For every case of autoshard/testing/kernel_cases.py at its benchmark shapes, forward alone (no
grad) and forward + backward: the time of the fused op, of the same function as plain torch code
run eagerly, and of that code under torch.compile. Bandwidth counts the fewest bytes the pass must
move (each input read once, each output written once) over the fused op's time, against the
device's copy bandwidth measured in the same run (a large device-to-device copy, bytes read plus
written). Times are medians of CUDA-event-timed CUDA graph replays (launch gaps out; where a
variant cannot be captured, of back-to-back launches on the stream, said in the `timing` column),
after warm-up; every input is far larger than the L2 cache. Fused and eager outputs are compared
before timing (where both are defined the same way). Targets (issue 5): memory-bound kernels at
>= 85% of the copy bandwidth, faster than eager and torch.compile.

On the CPU the fused ops run their torch implementations and time goes by the host clock: the
numbers check the script, they measure nothing.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from results import report  # noqa: E402
from tabulate import tabulate  # noqa: E402
from timing import median_seconds  # noqa: E402

from autoshard.testing.kernel_cases import CASES, KernelCase, make_inputs  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
QUICK_SHAPES = {4: (2, 2, 64, 64), 2: (256, 512)}       # by rank: scores / q-k heads, rows x cols


def _shapes(case: KernelCase, quick: bool) -> tuple[tuple[int, ...], ...]:
    return (QUICK_SHAPES[len(case.bench[0])],) if quick else case.bench


# ---- timing -------------------------------------------------------------------------------------
def _host_time(fn: Callable[[], object], reps: int, warmup: int) -> tuple[float, str]:
    for _ in range(warmup):
        fn()
    return median_seconds(fn, torch.device("cpu"), reps), "host clock"


def _capture(fn: Callable[[], object]) -> Callable[[], None] | None:
    """`fn` as a CUDA graph's replay, or None where it cannot be captured."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):                 # allocations and lazy work out of the capture
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            fn()
    except Exception as e:  # noqa: BLE001  (any capture failure: time without the graph, and say so)
        print(f"    (no CUDA graph: {type(e).__name__}: {str(e).splitlines()[0][:100]})")
        torch.cuda.synchronize()
        return None
    return graph.replay


def _cuda_time(fn: Callable[[], object], reps: int, warmup: int) -> tuple[float, str]:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    replay = _capture(fn)
    run, how = (replay, "graph") if replay is not None else (fn, "stream")
    run()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, end in events:
        start.record()
        run()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events) / 1e3, how


def copy_bandwidth(device: torch.device, nbytes: int, timer) -> float:
    """Bytes read plus bytes written per second by a device-to-device copy of `nbytes`."""
    src = torch.randn(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    sec, _ = timer(lambda: dst.copy_(src), 20, 3)
    return 2 * nbytes / sec


# ---- one case -----------------------------------------------------------------------------------
def passes_of(case: KernelCase, fn: Callable, inputs: dict, grad_out: torch.Tensor) -> dict[str, Callable[[], object]]:
    """Forward alone (no grad) and forward + backward of `fn` on `inputs`."""
    leaves = [inputs[k] for k in case.grads]

    def fwd():
        with torch.no_grad():
            return fn(**inputs)

    def fwd_bwd():
        return torch.autograd.grad(fn(**inputs), leaves, grad_out)
    return {"fwd": fwd, "fwd+bwd": fwd_bwd}


def _agree(case: KernelCase, inputs: dict, dtype: torch.dtype) -> str:
    if not case.same_as_eager:
        return "n/a"
    with torch.no_grad():
        a, b = case.fused(**inputs).double(), case.eager(**inputs).double()
    err = ((a - b).norm() / b.norm()).item()
    return f"{'ok' if err <= (1e-5 if dtype == torch.float32 else 2e-2) else 'DIFFERS'} {err:.0e}"


def bench_case(case: KernelCase, shape, dtype, device, timer, compile_: bool, reps: int) -> list[list]:
    inputs = make_inputs(case, shape, dtype, device, seed=0)
    agree = _agree(case, inputs, dtype)
    with torch.no_grad():
        grad_out = torch.randn_like(case.fused(**inputs))
    variants = {"fused": case.fused, "eager": case.eager}
    if compile_:
        variants["compiled"] = torch.compile(case.eager, dynamic=False)
    passes = {name: passes_of(case, fn, inputs, grad_out) for name, fn in variants.items()}
    rows = []
    for pass_name, nbytes in (("fwd", case.fwd_bytes(inputs)),
                              ("fwd+bwd", case.fwd_bytes(inputs) + case.bwd_bytes(inputs))):
        secs, how = {}, set()
        for name in variants:
            secs[name], mode = timer(passes[name][pass_name], reps, 3)
            how.add(mode)
        fused = secs["fused"]
        compiled = secs.get("compiled")
        rows.append([case.name, "x".join(map(str, shape)), pass_name, nbytes / 1e6, 1e6 * fused, nbytes / fused / 1e9,
                     None, 1e6 * secs["eager"], None if compiled is None else 1e6 * compiled,
                     secs["eager"] / fused, None if compiled is None else compiled / fused, agree,
                     "/".join(sorted(how))])
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    ap.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES))
    ap.add_argument("--quick", action="store_true", help="tiny sizes, few repetitions: checks the script")
    ap.add_argument("--no-compile", dest="compile", action="store_false", help="leave torch.compile out")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--append", action="store_true", help="append the table to benchmarks/RESULTS.md")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device.type == "cuda"
    timer = _cuda_time if cuda else _host_time
    dtype = DTYPES[args.dtype] if cuda else torch.float32
    reps = 3 if args.quick else args.reps
    copy_bw = copy_bandwidth(device, (64 << 20) if args.quick else (4 << 30), timer)
    rows = []
    for name in args.cases:
        for shape in _shapes(CASES[name], args.quick):
            print(f"  {name} {shape}", flush=True)
            rows += bench_case(CASES[name], shape, dtype, device, timer, args.compile, reps)
            if cuda:
                torch.cuda.empty_cache()
    for row in rows:
        row[6] = 100 * row[5] * 1e9 / copy_bw
    table = tabulate(rows, floatfmt=".2f", tablefmt="github", headers=[
        "kernel", "shape", "pass", "min MB", "fused us", "GB/s", "% copy BW", "eager us", "compile us",
        "x eager", "x compile", "fused vs eager", "timing"])
    worst = min(rows, key=lambda r: r[6])
    slower = [f"{r[0]} {r[1]} {r[2]}" for r in rows
              if r[9] < 1 or (r[10] is not None and r[10] < 1)]
    summary = (f"{torch.cuda.get_device_name(device) if cuda else 'cpu'}, {dtype}; copy bandwidth measured "
               f"{copy_bw / 1e9:.0f} GB/s (read + write). Lowest: {worst[6]:.0f}% of it ({worst[0]} {worst[1]} "
               f"{worst[2]}); slower than eager or torch.compile: {', '.join(slower) or 'none'}")
    report(table, summary, append=args.append and cuda and not args.quick, title="Fused kernels",
           command=f"python benchmarks/kernels.py --dtype {args.dtype}",
           what=f"median of {reps} timed runs after warm-up; fused = torch.ops.autoshard.*")


if __name__ == "__main__":
    main()
