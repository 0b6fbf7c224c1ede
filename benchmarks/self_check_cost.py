"""What the kernels' first-use self-check costs a process (target: under 100 ms), per op and dtype.

    python benchmarks/self_check_cost.py [--dtypes bf16 fp32] [--append]

Runs every op of autoshard/testing/kernel_cases.py forward and backward once on a small input in a
fresh process, with the self-check on, and reports the time each check took (kernel and torch
implementation on the small input, compared). On a CUDA GPU the kernels are CuPy launches, and
since the check is a kernel's first launch, its time there includes CuPy compiling or loading the
module, which the first launch pays with or without the check. Without a GPU it runs the CPU
executor: the same launches, run by fibers on the host and far slower than on a GPU, so its total
bounds the launch part of the cost from above; it is not a GPU figure.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from results import report  # noqa: E402
from tabulate import tabulate  # noqa: E402

from autoshard.kernels import cpu_executor, self_check  # noqa: E402
from autoshard.testing.kernel_cases import CASES, make_inputs  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def run_all(dtypes: list[torch.dtype], device: str) -> None:
    for case in CASES.values():
        for dtype in dtypes:
            shape = (2, 2, 8, 8) if len(case.shapes[0]) == 4 else (4, 24)
            inputs = make_inputs(case, shape, dtype, device, 0)
            out = case.fused(**inputs)
            torch.autograd.grad(out, [inputs[k] for k in case.grads], torch.ones_like(out))


def model_process(device: str) -> tuple[int, float]:
    """The checks a fused Llama's first training step runs, and their total milliseconds."""
    from autoshard import autoshard
    from autoshard.testing.models import VOCAB, build_model
    self_check.reset()
    torch.manual_seed(0)
    model = build_model("llama", heads=8, kv_heads=2).to(device)
    ids = torch.randint(0, VOCAB, (2, 16), device=device)
    prog = autoshard(model, tp=2, example_kwargs={"input_ids": ids, "labels": ids}, fuse=True)
    if device == "cpu":
        with cpu_executor.enabled(self_check=True):
            prog.simulate(input_ids=ids, labels=ids).loss.backward()
    else:
        prog.simulate(input_ids=ids, labels=ids).loss.backward()
    return len(self_check.RESULTS), 1e3 * sum(s for _, s in self_check.RESULTS.values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", nargs="+", default=["bf16"], choices=list(DTYPES))
    ap.add_argument("--append", action="store_true", help="record the table in benchmarks/RESULTS.md")
    args = ap.parse_args()
    dtypes = [DTYPES[d] for d in args.dtypes]
    if torch.cuda.is_available():
        device, where = "cuda", torch.cuda.get_device_name()
        run_all(dtypes, device)
    elif cpu_executor.compiler() is None:
        print("nothing to measure: no GPU, and no host C++ compiler for the CPU executor (apt install g++)")
        return
    else:
        device, where = "cpu", "the CPU executor (no GPU)"
        cpu_executor.library()                     # built (or loaded from the cache) before timing
        with cpu_executor.enabled(self_check=True):
            run_all(dtypes, device)
    rows = [(op, str(dt).removeprefix("torch."), " ".join(map(str, variant)), "pass" if ok else "FAIL",
             f"{seconds * 1e3:.1f}")
            for (op, dt, _, variant), (ok, seconds) in sorted(self_check.RESULTS.items(), key=lambda kv: str(kv[0]))]
    total = sum(s for _, s in self_check.RESULTS.values())
    ok = all(passed for passed, _ in self_check.RESULTS.values())
    table = tabulate(rows, headers=["op", "dtype", "variant", "check", "ms"], tablefmt="github")
    model_checks, model_ms = model_process(device)
    summary = (f"{len(rows)} checks on {where} (every variant of every op): {total * 1e3:.0f} ms in all, "
               f"{total * 1e3 / max(1, len(rows)):.1f} ms each. A process training fused Llama (tp=2 rank "
               f"programs, fp32, one forward and backward): {model_checks} checks, {model_ms:.0f} ms "
               f"(target: under 100 ms per process)")
    report(table, summary, append=args.append, title="Kernel self-check cost",
           command=f"python benchmarks/self_check_cost.py --dtypes {' '.join(args.dtypes)}", what=where)
    if not ok:
        sys.exit("a kernel failed its self-check")


if __name__ == "__main__":
    main()
