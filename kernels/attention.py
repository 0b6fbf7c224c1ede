"""Attention whose explicit mask may be the causal one: SDPA's own causal path when it is.

Exported Hugging Face models build their causal mask as a tensor (tracing takes the branch that
materializes it), where the eager model passes none and asks SDPA for `is_causal=True`, and
repeat key/value heads by hand (`repeat_kv`) where eager SDPA takes `enable_gqa=True`.
passes/causal_attention.py rewrites such calls to `attention` below, with `causal` computed once
per mask by `is_causal_mask` (in the cached size-only tables, passes/tables.py): the causal path
runs only when the mask is exactly the lower triangle, the masked path otherwise. No CUDA kernel:
both paths are torch's SDPA.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["attention", "is_causal_mask", "causal_attention_at"]


def is_causal_mask(mask: torch.Tensor) -> bool:
    """True when `mask` ([..., L, S]) keeps exactly the lower triangle (key j <= query i) of every
    [L, S] slice: True / False for a boolean mask, 0 / -inf (or the dtype's lowest) for an additive one.
    Under torch.compile always False (reading the values would break the graph): the mask is used."""
    if mask.dim() < 2 or torch.compiler.is_compiling():
        return False
    keep = torch.ones(mask.shape[-2:], dtype=torch.bool, device=mask.device).tril().expand_as(mask)
    if mask.dtype == torch.bool:
        return bool(torch.equal(mask, keep))
    if not mask.is_floating_point():
        return False
    lowest = torch.finfo(mask.dtype).min
    dropped = mask[~keep]
    return bool((mask[keep] == 0).all()) and bool(((dropped == float("-inf")) | (dropped == lowest)).all())


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, causal: bool, *,
              scale: float | None = None, repeat: int = 1, enable_gqa: bool = False,
              sdpa=F.scaled_dot_product_attention) -> torch.Tensor:
    """SDPA of q [b, h, L, e] with k, v [b, h / repeat, S, e] (each key/value head serving `repeat`
    query heads, as repeat_kv repeats them) under `mask`; `causal` says `mask` is the lower triangle.
    `sdpa`: the SDPA to call (a rank read on meta tensors passes one that picks the backend its
    device would: planning/meta_ops.py)."""
    if causal and tuple(mask.shape[-2:]) == (q.shape[-2], k.shape[-2]):
        return sdpa(q, k, v, is_causal=True, scale=scale, enable_gqa=enable_gqa or repeat > 1)
    if repeat > 1:
        k, v = k.repeat_interleave(repeat, dim=-3), v.repeat_interleave(repeat, dim=-3)
    return sdpa(q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)


def causal_attention_at(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, *,
                        dropout_p: float = 0.0, scale: float | None = None, enable_gqa: bool = False) -> torch.Tensor:
    """Causal SDPA of queries at global `positions` (q [b, h, L, e], L = len(positions)) against
    every key of the sequence (k, v [b, h_kv, S, e], in position order): query i sees keys
    0 ... positions[i]. Context parallelism's form of `is_causal=True` (a rank's queries are not the
    first L positions, so SDPA's top-left causal triangle would be wrong)."""
    keys = torch.arange(k.shape[-2], device=positions.device)
    mask = keys[None, :] <= positions[:, None]            # (L, S)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale,
                                          enable_gqa=enable_gqa)
