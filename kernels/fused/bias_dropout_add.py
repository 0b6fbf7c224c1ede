"""Bias + dropout + residual: residual + dropout(x + bias, p) in one element-wise pass
(kernels/cuda/bias_dropout_add.cu). The keep mask is a hash of (seed, element index), so the backward
regenerates it instead of storing it; `keep_mask` computes the same hash with torch ops, bit for bit.

    y = bias_dropout_add(x, bias, residual, p)      # seed drawn from torch's generator unless given
"""
from __future__ import annotations

import math

import numpy as np
import torch

from autoshard.kernels.dispatch import FULL, LIB, VECTOR, FusedOp, Kernel
from autoshard.kernels.launch import contiguous, elementwise_blocks, empty_like, run_kernel, vec
from autoshard.kernels.reference import acc_dtype, broadcast_result, result_dtype, sum_to, widened

__all__ = ["bias_dropout_add", "draw_seed", "OP"]

_M32 = 0xFFFFFFFF


# ---- the exact torch implementation: what runs without the kernel, and what it is checked against
def _mul32(a: torch.Tensor, c: int) -> torch.Tensor:
    """(a * c) mod 2**32 for 0 <= a < 2**32 in int64, without overflow: 16-bit halves."""
    return ((a & 0xFFFF) * c + ((((a >> 16) * c) & 0xFFFF) << 16)) & _M32


def _mix32(h: torch.Tensor) -> torch.Tensor:          # bias_dropout_add.cu's mix32, bit for bit
    h = h ^ (h >> 16)
    h = _mul32(h, 0x7FEB352D)
    h = h ^ (h >> 15)
    h = _mul32(h, 0x846CA68B)
    return h ^ (h >> 16)


def keep_mask(shape: torch.Size, p: float, seed: int, device) -> torch.Tensor:
    """The dropout keep mask of bias_dropout_add.cu: element i kept when hash(seed, i) >= p."""
    i = torch.arange(math.prod(shape), dtype=torch.int64, device=device)
    h = _mix32((seed & _M32) ^ _mix32(((i & _M32) + _mix32((i >> 32) & _M32)) & _M32))
    u = (h >> 8).to(torch.float32) * (1.0 / 16777216.0)
    return (u >= torch.tensor(p, dtype=torch.float32)).view(shape)


def bias_dropout_add_fwd(x, b, residual, p: float, seed: int) -> torch.Tensor:
    out = result_dtype(x, b, residual)
    acc = acc_dtype(out)
    v = x.to(acc) + widened(b, acc)
    if p > 0 and v.shape != residual.shape:
        raise ValueError(f"bias_dropout_add with p > 0 needs x + bias {tuple(v.shape)} shaped like the "
                         f"residual {tuple(residual.shape)}")
    if p > 0:
        v = torch.where(keep_mask(x.shape, p, seed, x.device), v / (1 - p), 0.0) if p < 1 else v * 0
    return (residual.to(acc) + v).to(out)


def bias_dropout_add_bwd(g, p: float, seed: int) -> torch.Tensor:
    if p == 0:
        return g.clone()
    if p >= 1:
        return torch.zeros_like(g)
    return torch.where(keep_mask(g.shape, p, seed, g.device), g.to(acc_dtype(g)) / (1 - p), 0.0).to(g.dtype)


# ---- the launches of kernels/cuda/bias_dropout_add.cu (kernels/launch.py: where and how they run)
def bias_dropout_add_launch(x, bias, residual, p, seed):
    x, bias, residual = x.contiguous(), contiguous(bias), residual.contiguous()
    y, cols = empty_like(x), x.shape[-1]
    run_kernel("bias_dropout_add_fwd", x, elementwise_blocks(x.numel()),
               (x, bias, residual, y, np.int64(x.numel()), np.int64(cols), np.float32(p),
                np.uint32(seed & 0xFFFFFFFF), np.int32(vec(cols, x, bias, residual, y))))
    return y


def bias_dropout_add_backward_launch(grad, p, seed):
    grad = grad.contiguous()
    dx = empty_like(grad)
    run_kernel("bias_dropout_add_bwd", grad, elementwise_blocks(grad.numel()),
               (grad, dx, np.int64(grad.numel()), np.float32(p), np.uint32(seed & 0xFFFFFFFF),
                np.int32(vec(grad.shape[-1], grad, dx))))
    return dx


# ---- the custom ops (torch.ops.autoshard.*): fake shapes for tracing, autograd, the function users call
@torch.library.custom_op(f"{LIB}::bias_dropout_add", mutates_args=())
def _bias_dropout_add(x: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor, p: float,
                      seed: int) -> torch.Tensor:
    return bias_dropout_add_fwd(x, bias, residual, p, seed).contiguous()


@torch.library.custom_op(f"{LIB}::bias_dropout_add_backward", mutates_args=())
def _bias_dropout_add_backward(grad: torch.Tensor, p: float, seed: int) -> torch.Tensor:
    return bias_dropout_add_bwd(grad, p, seed).contiguous()


@_bias_dropout_add.register_fake
def _(x, bias, residual, p, seed):
    return broadcast_result(x, bias, residual)


@_bias_dropout_add_backward.register_fake
def _(grad, p, seed):
    return grad.new_empty(grad.shape)


def _bda_setup(ctx, inputs, output):
    ctx.likes = tuple(None if t is None else (t.shape, t.dtype) for t in inputs[:3])
    ctx.p, ctx.seed = inputs[3], inputs[4]


def _bda_grad(ctx, grad):
    x, bias, residual = ctx.likes
    dx = _bias_dropout_add_backward(grad, ctx.p, ctx.seed)
    return sum_to(dx, x), sum_to(dx, bias), sum_to(grad, residual), None, None


_bias_dropout_add.register_autograd(_bda_grad, setup_context=_bda_setup)


def draw_seed(device: torch.device | str = "cpu") -> int:
    """A 31-bit seed from torch's generator for `device` (so torch.manual_seed and autoshard's
    per-region RNG states govern the fused dropout too)."""
    return int(torch.randint(0, 2**31 - 1, (1,), device=device).item())


def bias_dropout_add(x: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor, p: float, *,
                     training: bool = True, seed: int | None = None) -> torch.Tensor:
    """residual + dropout(x + bias, p); the mask is a hash of (seed, element index), regenerated in
    backward instead of stored."""
    if not 0 <= p <= 1:
        raise ValueError(f"dropout probability must be in [0, 1], got {p}")
    p = float(p) if training else 0.0
    return _bias_dropout_add(x, bias, residual, p, draw_seed(x.device) if seed is None and p > 0 else (seed or 0))


# which calls run the kernel (kernels/dispatch.py): argument slots, dtype promotion, a further test
OP = FusedOp("bias_dropout_add.cu", {
    "bias_dropout_add": Kernel(bias_dropout_add_launch, {1: VECTOR, 2: FULL}, True),
    "bias_dropout_add_backward": Kernel(bias_dropout_add_backward_launch, {}, False),
}, (_bias_dropout_add, _bias_dropout_add_backward,))
