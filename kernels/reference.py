"""What the fused ops' exact torch implementations share (each op's own is in kernels/fused/):
dtypes and the shapes of broadcast inputs. Arithmetic in fp32 (fp64 for fp64 inputs). The
element-wise ops return the dtype torch's type promotion gives the expression they replace (`x +
bias` with a bf16 x and an fp32 bias is fp32); norm, softmax and rotary return their input's dtype.
"""
from __future__ import annotations

import functools

import torch

__all__ = ["acc_dtype", "result_dtype", "widened", "sum_to", "broadcast_result"]


def acc_dtype(x: torch.Tensor | torch.dtype) -> torch.dtype:
    """The dtype an op computes in: fp32, or fp64 for fp64 inputs."""
    return torch.promote_types(x if isinstance(x, torch.dtype) else x.dtype, torch.float32)


def result_dtype(*ts: torch.Tensor | None) -> torch.dtype:
    """The dtype of an element-wise expression over `ts` under torch's type promotion."""
    return functools.reduce(torch.promote_types, (t.dtype for t in ts if t is not None))


def widened(x: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | float:
    """An optional operand (a bias) in the compute dtype; an absent one adds nothing."""
    return 0.0 if x is None else x.to(dtype)


def sum_to(t: torch.Tensor, like: torch.Tensor | tuple | None) -> torch.Tensor | None:
    """The gradient of a broadcast input: `t` summed down to `like`'s shape (a tensor, or a (shape,
    dtype) pair). The ops broadcast as the unfused torch code does (the fusion pass relies on it);
    the CUDA kernels take the plain case and leave the rest to the torch implementation."""
    if like is None:
        return None
    shape, dtype = like if isinstance(like, tuple) else (like.shape, like.dtype)
    return t.sum_to_size(shape).to(dtype)


def broadcast_result(*ts: torch.Tensor | None) -> torch.Tensor:
    """The result of an element-wise op over `ts`: broadcast shape, promoted dtype (fake kernels)."""
    live = [t for t in ts if t is not None]
    shape = torch.broadcast_shapes(*(t.shape for t in live))
    return live[0].new_empty(shape, dtype=result_dtype(*live))
