"""Experts' matmul with one expert per row: what Hugging Face's `batched_mm` experts compute.

    out = gathered_linear(x, w, ids)      # x [S, in], w [experts, in, out], ids [S] -> [S, out]

Row s is x[s] @ w[ids[s]]. HF writes it as `bmm(W[ids], x.unsqueeze(-1)).squeeze(-1)` on the
stored [experts, out, in] weight; passes/gathered_experts.py rewrites that pattern to this op (the
weight read through a transpose of its last two dims, as `grouped_mm_fallback` reads it) so that the
sharding analysis sees one matmul against a parameter (passes/sharding/rules_experts.py). No CUDA
kernel: the same torch ops, under autograd.
"""
from __future__ import annotations

import torch

__all__ = ["gathered_linear"]


def gathered_linear(x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return torch.bmm(x.unsqueeze(1), w[ids]).squeeze(1)        # [S, 1, in] @ [S, in, out] -> [S, out]
