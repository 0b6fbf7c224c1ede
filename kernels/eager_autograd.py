"""The fused ops' autograd where a graph runs them eagerly on plain tensors: straight to the op's
kernel-or-torch run (kernels/dispatch.py), forward and backward, one torch.autograd.Function per op.

Why: torch's custom-op autograd (`register_autograd`, kept as the formula: each op's setup and
backward functions in kernels/fused/) wraps every call in Python layers (its arguments' defaults
filled, a metadata object, a redispatch through the dispatcher back into the op's Python kernel)
that cost the host more than the eager ops a fused op replaces (benchmarks/launch_overhead.py
--noop-launch). The kernels here are registered for AutogradCPU and AutogradCUDA, which the
dispatcher picks before the custom op's own kernel for the Autograd alias key.

Plain tensors (torch.Tensor itself, not meta) with no dispatch mode active take the direct road.
Anything else (fake or functional tensors while torch.compile or torch.export traces, meta tensors of
a memory prediction, a dispatch mode watching the ops) goes below autograd through the dispatcher,
as the custom op's own autograd does: a traced graph still holds the custom ops, forward and
backward, and a mode still sees them.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["eager_autograd"]


def _plain(args: tuple) -> bool:
    if torch._C._len_torch_dispatch_stack():
        return False
    return all(type(a) is torch.Tensor and not a.is_meta for a in args if isinstance(a, torch.Tensor))


def eager_autograd(custom, direct: Callable) -> Callable:
    """The AutogradCPU / AutogradCUDA kernel of custom op `custom` (a torch.library.custom_op),
    `direct(*args)` its kernel-or-torch run."""
    op = custom._opoverload
    backward, setup = getattr(custom, "_backward_fn", None), getattr(custom, "_setup_context_fn", None)

    def below(args: tuple):
        if _plain(args):
            return direct(*args)
        with torch._C._AutoDispatchBelowAutograd():
            return op(*args)

    def forward(ctx, *args):
        out = below(args)
        setup(ctx, args, out)
        ctx.set_materialize_grads(False)
        first = out[0] if isinstance(out, tuple) else out
        ctx.first = (first.shape, first.dtype, first.device)
        return out

    def backward_(ctx, *grads):
        if grads[0] is None:          # only another output's gradient reached it (a norm's statistics)
            shape, dtype, device = ctx.first
            grads = (torch.zeros(shape, dtype=dtype, device=device), *grads[1:])
        return backward(ctx, *grads)

    # named for the op: its autograd node reads `<op>_eagerBackward` (the class name is read when it is made)
    Eager = type(f"{op._schema.name.split('::')[-1]}_eager", (torch.autograd.Function,),
                 {"forward": staticmethod(forward), "backward": staticmethod(backward_)})

    def kernel(*args):
        if torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
            if backward is None:
                raise RuntimeError(f"{op}: no autograd formula (it is a backward op: no double backward)")
            return Eager.apply(*args)
        return below(args)
    return kernel
