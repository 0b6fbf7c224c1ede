"""Norms the sharding analysis sees as one op.

    out = per_head_layer_norm(x, w, b, dim, k, eps)   # x [..., H (at dim), ..., *norm], w/b [H, *norm] or None

Each of the H slices of x along `dim` is layer-normed over its last k dims with its own weight and
bias: what a model writes as a list of LayerNorm modules, one per head, applied to
`x.split(1, dim)` and concatenated back (StableLM's q/k layernorm). passes/per_head_norms.py puts
this op in place of that pattern so that passes/sharding/rules_reduce.py can split it with the heads.
No CUDA kernel: torch ops under autograd.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["per_head_layer_norm"]


def per_head_layer_norm(x: torch.Tensor, w: torch.Tensor | None, b: torch.Tensor | None, dim: int, k: int,
                        eps: float) -> torch.Tensor:
    y = F.layer_norm(x, tuple(x.shape[x.dim() - k:]), None, None, eps)
    between = x.dim() - k - dim - 1              # dims after the heads and before the normalized ones
    if w is not None:
        y = y * w.reshape(w.shape[0], *([1] * between), *w.shape[1:])   # [H, 1.., *norm]
    if b is not None:
        y = y + b.reshape(b.shape[0], *([1] * between), *b.shape[1:])
    return y
