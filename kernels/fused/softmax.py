"""Scaled masked softmax over attention scores: softmax(scale * x) along the keys, masked keys
(a [1 or batch, sq, sk] mask, nonzero = masked) and, with `causal`, keys above the diagonal set to
zero; a fully masked row is all zeros (kernels/cuda/softmax.cu, one block per row).

    p = scaled_masked_softmax(scores, mask, scale, causal)     # scores [batch, heads, sq, sk]
"""
from __future__ import annotations

import math

import numpy as np
import torch

from autoshard.kernels.dispatch import FULL, LIB, MASK, FusedOp, Kernel
from autoshard.kernels.launch import empty_like, run_kernel
from autoshard.kernels.reference import acc_dtype

__all__ = ["scaled_masked_softmax", "OP"]


# ---- the exact torch implementation: what runs without the kernel, and what it is checked against
def _masked(x: torch.Tensor, mask: torch.Tensor | None, causal: bool) -> torch.Tensor:
    sq, sk = x.shape[-2], x.shape[-1]
    off = torch.zeros(sq, sk, dtype=torch.bool, device=x.device)
    if causal:
        off = torch.ones(sq, sk, dtype=torch.bool, device=x.device).triu(sk - sq + 1)
    if mask is not None:
        off = off | mask.bool().unsqueeze(1)            # (1 or b, 1, sq, sk): shared by the heads
    return off


def softmax_fwd(x, mask, scale: float, causal: bool) -> torch.Tensor:
    acc = acc_dtype(x)
    off = _masked(x, mask, causal)
    z = (x.to(acc) * scale).masked_fill(off, -math.inf)
    top = z.amax(-1, keepdim=True)
    e = torch.where(off, 0.0, torch.exp(z - top.masked_fill(top == -math.inf, 0.0)))
    total = e.sum(-1, keepdim=True)
    return torch.where(total > 0, e / total.clamp_min(torch.finfo(acc).tiny), 0.0).to(x.dtype)


def softmax_bwd(g, y, scale: float) -> torch.Tensor:
    acc = acc_dtype(y)
    g, yy = g.to(acc), y.to(acc)
    return (scale * yy * (g - (g * yy).sum(-1, keepdim=True))).to(y.dtype)


# ---- the launches of kernels/cuda/softmax.cu (kernels/launch.py: where and how they run)
def softmax_launch(x, mask, scale, causal):
    x = x.contiguous()
    b, h, sq, sk = x.shape
    m = None if mask is None else (mask != 0).to(torch.uint8).contiguous()     # nonzero = masked, any dtype
    y = empty_like(x)
    run_kernel("scaled_masked_softmax_fwd", x, b * h * sq,
               (x, m, y, np.int64(b * h * sq), np.int64(sq), np.int64(sk), np.int64(h),
                np.float32(scale), np.int32(causal), np.int32(m is not None and m.shape[0] > 1)), threads=128)
    return y


def softmax_backward_launch(grad, y, scale):
    grad, y = grad.contiguous(), y.contiguous()
    dx, sk = empty_like(y), y.shape[-1]
    rows = y.numel() // sk
    run_kernel("scaled_masked_softmax_bwd", y, rows,
               (grad, y, dx, np.int64(rows), np.int64(sk), np.float32(scale)), threads=128)
    return dx


# ---- the custom ops (torch.ops.autoshard.*): fake shapes for tracing, autograd, the function users call
@torch.library.custom_op(f"{LIB}::scaled_masked_softmax", mutates_args=())
def _softmax(x: torch.Tensor, mask: torch.Tensor | None, scale: float, causal: bool) -> torch.Tensor:
    return softmax_fwd(x, mask, scale, causal).contiguous()


@torch.library.custom_op(f"{LIB}::scaled_masked_softmax_backward", mutates_args=())
def _softmax_backward(grad: torch.Tensor, y: torch.Tensor, scale: float) -> torch.Tensor:
    return softmax_bwd(grad, y, scale).contiguous()


@_softmax.register_fake
def _(x, mask, scale, causal):
    return x.new_empty(x.shape)                      # contiguous, as the implementations return it


@_softmax_backward.register_fake
def _(grad, y, scale):
    return y.new_empty(y.shape)


def _softmax_setup(ctx, inputs, output):
    ctx.save_for_backward(output)
    ctx.scale = inputs[2]


def _softmax_grad(ctx, grad):
    (y,) = ctx.saved_tensors
    return _softmax_backward(grad, y, ctx.scale), None, None, None


_softmax.register_autograd(_softmax_grad, setup_context=_softmax_setup)


def scaled_masked_softmax(x: torch.Tensor, mask: torch.Tensor | None = None, scale: float = 1.0,
                          causal: bool = False) -> torch.Tensor:
    """softmax(scale * x) over the last dim of [b, heads, sq, sk] scores, keys masked where `mask`
    [1 or b, sq, sk] is nonzero and, with `causal`, above the diagonal; fully masked rows are 0."""
    if x.dim() != 4:
        raise ValueError(f"scaled_masked_softmax takes [batch, heads, sq, sk] scores, got {tuple(x.shape)}")
    if mask is not None and (mask.dim() != 3 or mask.shape[1:] != x.shape[2:] or mask.shape[0] not in (1, x.shape[0])):
        raise ValueError(f"mask {tuple(mask.shape)} is not [1 or {x.shape[0]}, {x.shape[2]}, {x.shape[3]}]")
    return _softmax(x, mask, float(scale), bool(causal))


def _scores(args: tuple) -> bool:
    return args[0].dim() == 4                        # [batch, heads, sq, sk]


# which calls run the kernel (kernels/dispatch.py): argument slots, dtype promotion, a further test
OP = FusedOp("softmax.cu", {
    "scaled_masked_softmax": Kernel(softmax_launch, {1: MASK}, False, _scores),
    "scaled_masked_softmax_backward": Kernel(softmax_backward_launch, {1: FULL}, False),
}, (_softmax, _softmax_backward,))
