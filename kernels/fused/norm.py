"""LayerNorm and RMSNorm over the last dim in one op (kernels/cuda/norm.cu, one block per row): the
forward keeps each row's mean and reciprocal standard deviation in fp32 for the backward, which
returns the weight's and bias's gradients summed over the rows.

    y = layer_norm(x, weight, bias, eps)
    y = rms_norm(x, weight, eps)
"""
from __future__ import annotations

import numpy as np
import torch

from autoshard.kernels.dispatch import FULL, LIB, ROWS, VECTOR, FusedOp, Kernel
from autoshard.kernels.launch import contiguous, empty, empty_like, run_kernel, sm_count
from autoshard.kernels.reference import acc_dtype

__all__ = ["layer_norm", "rms_norm", "OP"]


# ---- the exact torch implementation: what runs without the kernel, and what it is checked against
def norm_fwd(x, w, b, eps: float, rms: bool):
    acc = acc_dtype(x)
    xf = x.to(acc)
    mean = torch.zeros(x.shape[:-1], dtype=acc, device=x.device) if rms else xf.mean(-1)
    var = ((xf - mean.unsqueeze(-1)) ** 2).mean(-1)
    rstd = torch.rsqrt(var + eps)
    y = (xf - mean.unsqueeze(-1)) * rstd.unsqueeze(-1)
    if w is not None:
        y = y * w.to(acc)
    if b is not None:
        y = y + b.to(acc)
    stat = torch.float64 if acc == torch.float64 else torch.float32
    return y.to(x.dtype), mean.to(stat), rstd.to(stat)


def norm_bwd(g, x, w, mean, rstd, rms: bool):
    """(dx, dw, db): dw and db summed over every leading dim, in the accumulation dtype."""
    acc = acc_dtype(x)
    gf, xh = g.to(acc), (x.to(acc) - mean.unsqueeze(-1).to(acc)) * rstd.unsqueeze(-1).to(acc)
    gw = gf * (w.to(acc) if w is not None else 1.0)
    m1 = 0.0 if rms else gw.mean(-1, keepdim=True)
    dx = rstd.unsqueeze(-1).to(acc) * (gw - m1 - xh * (gw * xh).mean(-1, keepdim=True))
    lead = tuple(range(x.dim() - 1))
    if not lead:                                     # a single row: sum(()) would sum every dim
        return dx.to(x.dtype), gf * xh, gf.clone()
    return dx.to(x.dtype), (gf * xh).sum(lead), gf.sum(lead)


# ---- the launches of kernels/cuda/norm.cu (kernels/launch.py: where and how they run)
def norm_launch(x, weight, bias, eps, rms):
    x, weight, bias = x.contiguous(), contiguous(weight), contiguous(bias)
    cols = x.shape[-1]
    rows = x.numel() // cols
    y = empty_like(x)
    mean = empty(x.shape[:-1], torch.float32, x.device)
    rstd = empty_like(mean)
    run_kernel("norm_fwd", x, rows, (x, weight, bias, y, mean, rstd, np.int64(rows),
                                     np.int64(cols), np.float32(eps), np.int32(rms)))
    return y, mean, rstd


def norm_backward_launch(grad, x, weight, mean, rstd, rms):
    grad, x, weight = grad.contiguous(), x.contiguous(), contiguous(weight)
    cols = x.shape[-1]
    rows = x.numel() // cols
    blocks = max(1, min(rows, 2 * sm_count(x)))
    dx = empty_like(x)
    dw = empty((blocks, cols), torch.float32, x.device)
    db = empty_like(dw)
    run_kernel("norm_bwd", x, blocks, (grad, x, weight, mean.contiguous(), rstd.contiguous(),
                                       dx, dw, db, np.int64(rows), np.int64(cols), np.int32(rms)))
    return dx, dw.sum(0), db.sum(0)


# ---- the custom ops (torch.ops.autoshard.*): fake shapes for tracing, autograd, the function users call
@torch.library.custom_op(f"{LIB}::norm", mutates_args=())
def _norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float,
          rms: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return tuple(t.contiguous() for t in norm_fwd(x, weight, bias, eps, rms))


@torch.library.custom_op(f"{LIB}::norm_backward", mutates_args=())
def _norm_backward(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, mean: torch.Tensor,
                   rstd: torch.Tensor, rms: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return tuple(t.contiguous() for t in norm_bwd(grad, x, weight, mean, rstd, rms))


@_norm.register_fake
def _(x, weight, bias, eps, rms):
    stat = torch.float64 if x.dtype == torch.float64 else torch.float32
    return x.new_empty(x.shape), x.new_empty(x.shape[:-1], dtype=stat), x.new_empty(x.shape[:-1], dtype=stat)


@_norm_backward.register_fake
def _(grad, x, weight, mean, rstd, rms):
    acc = acc_dtype(x)
    return x.new_empty(x.shape), x.new_empty(x.shape[-1:], dtype=acc), x.new_empty(x.shape[-1:], dtype=acc)


def _norm_setup(ctx, inputs, output):
    x, weight, bias, _, rms = inputs
    ctx.save_for_backward(x, weight, output[1], output[2])
    ctx.rms, ctx.bias_like = rms, bias


def _norm_grad(ctx, grad, _gmean, _grstd):
    x, weight, mean, rstd = ctx.saved_tensors
    dx, dw, db = _norm_backward(grad, x, weight, mean, rstd, ctx.rms)
    bias = ctx.bias_like
    return (dx, None if weight is None else dw.to(weight.dtype), None if bias is None else db.to(bias.dtype),
            None, None)


_norm.register_autograd(_norm_grad, setup_context=_norm_setup)
# No autocast rule (CUDA autocast runs layer_norm in fp32): registering one with
# torch.library.register_autocast made a later call of another autoshard op segfault inside torch's
# dispatch (torch 2.13; 8 runs in 8 of tests/simulation/test_fuse.py then the rotary test). passes/fusion/fuse.py
# says what that leaves different.


def layer_norm(x: torch.Tensor, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None,
               eps: float = 1e-5) -> torch.Tensor:
    """LayerNorm over the last dim (torch.nn.functional.layer_norm with normalized_shape = x.shape[-1:])."""
    return _norm(x, weight, bias, float(eps), False)[0]


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight over the last dim (Llama's RMSNorm)."""
    return _norm(x, weight, None, float(eps), True)[0]


# which calls run the kernel (kernels/dispatch.py): argument slots, dtype promotion, a further test
OP = FusedOp("norm.cu", {
    "norm": Kernel(norm_launch, {1: VECTOR, 2: VECTOR}, False),
    "norm_backward": Kernel(norm_backward_launch, {1: FULL, 2: VECTOR, 3: ROWS, 4: ROWS}, False),
}, (_norm, _norm_backward,))
