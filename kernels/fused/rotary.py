"""Rotary position embedding, rotate-half form: x * cos + rotate_half(x) * sin for q and k
[b, heads, s, d] with tables [1 or b, s, d] shared by the heads (kernels/cuda/rope.cu). Its backward
is the same op with the rotation inverted (the transpose); no gradient reaches the tables.

    q, k = rotary(q, k, cos, sin)
"""
from __future__ import annotations

import numpy as np
import torch

from autoshard.kernels.dispatch import LIB, TABLE, FusedOp, Kernel
from autoshard.kernels.launch import KERNEL_DTYPES, elementwise_blocks, empty_like, run_kernel
from autoshard.kernels.reference import acc_dtype, result_dtype

__all__ = ["rotary", "OP"]


# ---- the exact torch implementation: what runs without the kernel, and what it is checked against
def rope_apply(x, cos, sin, inverse: bool, half: int) -> torch.Tensor:
    """x [b, h, s, d]; cos, sin [1 or b, s, d] shared by the heads; the rotation pairs the two parts
    of d split at `half` (d / 2 in every model we know). inverse: the backward (the transpose)."""
    if x.dim() != 4 or not 0 < half < x.shape[-1]:
        raise ValueError(f"rotary: x {tuple(x.shape)} must be [b, heads, s, d] with 0 < half ({half}) < d")
    out = result_dtype(x, cos, sin)                  # x * cos promotes, as the unfused code does
    acc, d = acc_dtype(out), x.shape[-1]
    xf, c, s = x.to(acc), cos.to(acc).unsqueeze(1), sin.to(acc).unsqueeze(1)
    if not inverse:
        rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1) * s
    else:                                            # the transpose of x -> cat([-x[h:], x[:h]]) * s
        xs = xf * s
        rotated = torch.cat([xs[..., d - half:], -xs[..., :d - half]], dim=-1)
    return (xf * c + rotated).to(out)


# ---- the launches of kernels/cuda/rope.cu (kernels/launch.py: where and how they run)
def rotary_launch(x, cos, sin, inverse, half):
    x = x.to(result_dtype(x, cos, sin)).contiguous()        # x * cos promotes (an fp32 table under autocast)
    c, s = cos.float().contiguous(), sin.float().contiguous()
    b, h, seq, d = x.shape
    y = empty_like(x)
    run_kernel("rope_apply", x, elementwise_blocks(x.numel()),
               (x, c, s, y, np.int64(b), np.int64(h), np.int64(seq), np.int64(d),
                np.int32(c.shape[0] > 1), np.int32(inverse)))
    return y


# ---- the custom ops (torch.ops.autoshard.*): fake shapes for tracing, autograd, the function users call
@torch.library.custom_op(f"{LIB}::rotary", mutates_args=())
def _rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool, half: int) -> torch.Tensor:
    return rope_apply(x, cos, sin, inverse, half).contiguous()


@_rotary.register_fake
def _(x, cos, sin, inverse, half):
    return x.new_empty(x.shape, dtype=result_dtype(x, cos, sin))


def _rotary_setup(ctx, inputs, output):
    x, cos, sin, inverse, half = inputs
    ctx.save_for_backward(cos, sin)
    ctx.inverse, ctx.half, ctx.x_dtype = inverse, half, x.dtype


def _rotary_grad(ctx, grad):
    cos, sin = ctx.saved_tensors
    return _rotary(grad, cos, sin, not ctx.inverse, ctx.half).to(ctx.x_dtype), None, None, None, None


_rotary.register_autograd(_rotary_grad, setup_context=_rotary_setup)


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding (rotate-half form) applied to q and k [b, heads, s, d] with cos, sin
    [1 or b, s, d] (no gradient flows into the tables)."""
    for name, t in (("q", q), ("k", k)):
        if t.dim() != 4 or t.shape[-1] % 2 or cos.shape[-2:] != t.shape[-2:]:
            raise ValueError(f"rotary: {name} {tuple(t.shape)} must be [b, heads, s, d] (d even) matching "
                             f"cos {tuple(cos.shape)} [1 or b, s, d]")
    cos, sin = cos.detach(), sin.detach()
    return _rotary(q, cos, sin, False, q.shape[-1] // 2), _rotary(k, cos, sin, False, k.shape[-1] // 2)


def _rotary_takes(args: tuple) -> bool:
    """The kernel rotates [b, heads, s, d] at the middle of d, in a dtype it has."""
    x, cos, sin, _, half = args
    return x.dim() == 4 and 2 * half == x.shape[-1] and result_dtype(x, cos, sin) in KERNEL_DTYPES


# which calls run the kernel (kernels/dispatch.py): argument slots, dtype promotion, a further test
OP = FusedOp("rope.cu", {
    "rotary": Kernel(rotary_launch, {1: TABLE, 2: TABLE}, False, _rotary_takes),
}, (_rotary,))
