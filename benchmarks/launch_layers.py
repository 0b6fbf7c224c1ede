"""A fused op's host time taken apart, one layer of its call path at a time, beside eager torch:

    python benchmarks/launch_layers.py [--calls 1000] [--append]      # on a CUDA GPU
    python benchmarks/launch_layers.py --calls 20                      # CPU: checks the script

Each row is one way to make the same call, from the launch alone up to the whole op with autograd,
so each difference between two rows is what one layer costs: the launch function
(kernels/launch.py: outputs allocated, arguments passed, the kernel queued), the dispatch table and
first-use check (kernels/dispatch.py, kernels/self_check.py), the custom op's registration and
autograd. Trivial custom ops of `clone` beside `torch.autograd.Function` and eager `clone` show
the custom-op machinery alone. bf16 [64, 256] on CUDA (fp32 on the CPU, where the launch runs the
CPU executor and the numbers mean nothing). Time: launch_overhead.py's (median of 5 rounds).
"""
from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from launch_overhead import per_call_us  # noqa: E402
from results import report  # noqa: E402
from tabulate import tabulate  # noqa: E402

from autoshard.kernels import cpu_executor, ops  # noqa: E402
from autoshard.kernels.dispatch import _with_fallback  # noqa: E402
from autoshard.kernels.fused.norm import _norm, norm_launch  # noqa: E402

_NS = "launch_layers"
_LIBRARIES: list[torch.library.Library] = []      # a Library unregisters its ops when collected


def _clone_ops(device_key: str) -> tuple[Callable, Callable]:
    """A custom op of `clone` (its kernel through register_kernel, its backward a clone) and the same
    op defined and registered with torch.library alone (no autograd)."""
    @torch.library.custom_op(f"{_NS}::clone_op", mutates_args=())
    def clone_op(x: torch.Tensor) -> torch.Tensor:
        return x.clone()
    clone_op.register_kernel(device_key.lower())(lambda x: x.clone())
    clone_op.register_autograd(lambda ctx, grad: grad.clone())
    lib = torch.library.Library(_NS, "FRAGMENT")
    lib.define("plain_clone(Tensor x) -> Tensor")
    lib.impl("plain_clone", lambda x: x.clone(), device_key)
    _LIBRARIES.append(lib)
    return clone_op, torch.ops.launch_layers.plain_clone


class _Clone(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad.clone()


def rows(device: torch.device, dtype: torch.dtype) -> list[tuple[str, str, bool, Callable]]:
    """(layer, what the row runs, whether autograd records it, the call)."""
    gen = torch.Generator(device).manual_seed(0)
    x = torch.randn(64, 256, generator=gen, device=device).to(dtype)
    w, b = (torch.randn(256, generator=gen, device=device).to(dtype) for _ in range(2))
    g = torch.randn(64, 256, generator=gen, device=device).to(dtype)
    xg, bg = x.clone().requires_grad_(), b.clone().requires_grad_()
    run = _with_fallback("norm", ops.KERNELS["norm"], _norm._init_fn)
    norm = torch.ops.autoshard.norm.default
    clone_op, plain_clone = _clone_ops("CUDA" if device.type == "cuda" else "CPU")
    tanh = "tanh"

    def both(f, *wrt):
        return lambda: torch.autograd.grad(f(), list(wrt), g)
    return [
        ("norm, no grad", "eager F.layer_norm", False, lambda: F.layer_norm(x, (256,), w, b)),
        ("norm, no grad", "norm_launch (the launch alone)", False, lambda: norm_launch(x, w, b, 1e-5, False)),
        ("norm, no grad", "dispatch (table, first-use key, launch)", False, lambda: run(x, w, b, 1e-5, False)),
        ("norm, no grad", "torch.ops.autoshard.norm (the op)", False, lambda: norm(x, w, b, 1e-5, False)),
        ("custom op", "eager clone", False, lambda: x.clone()),
        ("custom op", "library op of clone", False, lambda: plain_clone(x)),
        ("custom op", "custom_op of clone, no grad", False, lambda: clone_op(x)),
        ("custom op", "eager clone fwd+bwd", True, both(lambda: xg.clone(), xg)),
        ("custom op", "autograd.Function clone fwd+bwd", True, both(lambda: _Clone.apply(xg), xg)),
        ("custom op", "custom_op clone fwd+bwd", True, both(lambda: clone_op(xg), xg)),
        ("bias_gelu", "eager gelu(x + b) fwd", True, lambda: F.gelu(xg + bg, approximate=tanh)),
        ("bias_gelu", "eager gelu(x + b) fwd+bwd", True, both(lambda: F.gelu(xg + bg, approximate=tanh), xg, bg)),
        ("bias_gelu", "fused fwd", True, lambda: ops.bias_gelu(xg, bg)),
        ("bias_gelu", "fused fwd+bwd", True, both(lambda: ops.bias_gelu(xg, bg), xg, bg)),
        ("bias_gelu", "its backward op alone, no grad", False,
         lambda: torch.ops.autoshard.bias_gelu_backward(g, x, b, tanh)),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=1000)
    ap.add_argument("--append", action="store_true")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if device.type == "cpu" and cpu_executor.compiler() is None:
        print("no GPU and no C++ compiler for the CPU executor: nothing to measure")
        return
    table_rows = []
    with cpu_executor.enabled() if device.type == "cpu" else contextlib.nullcontext():
        for layer, what, grad, call in rows(device, dtype):
            with torch.set_grad_enabled(grad):
                table_rows.append([layer, what, per_call_us(call, device, args.calls)])
    table = tabulate(table_rows, floatfmt=".1f", tablefmt="github", headers=["layer", "call", "host us/call"])
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (the CPU executor)"
    op = next(r[2] for r in table_rows if r[1].startswith("torch.ops"))
    eager = table_rows[0][2]
    report(table, f"{where}, {dtype}, [64, 256]; {args.calls} calls per round; the norm op {op:.0f} us "
                  f"against eager layer_norm's {eager:.0f}", append=args.append and device.type == "cuda",
           title="A fused op's host time by layer", command=f"python benchmarks/launch_layers.py --calls {args.calls}",
           what="median of 5 rounds per row")


if __name__ == "__main__":
    main()
