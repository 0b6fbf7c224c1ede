"""Experts' matmuls on stacked [experts, in, out] weights, as the sharding analysis sees them.

    out = gathered_linear(x, w, ids)      # x [S, in], w [experts, in, out], ids [S] -> [S, out]
    out = einsum_linear(x, w, "btd,edh->bteh")
    out = selected_linear(x, w, e, bias)  # x [.., in], w [experts, out, in] (as stored), e an int -> [.., out]

gathered_linear: row s is x[s] @ w[ids[s]] (Hugging Face's `batched_mm` experts, written there as
`bmm(W[ids], x.unsqueeze(-1)).squeeze(-1)` on the stored [experts, out, in] weight). einsum_linear:
an einsum against the weight. selected_linear: F.linear(x, w[e], bias), one expert's weight chosen
by a Python loop over the experts (JetMoE's `F.linear(inputs[i], self.weight[i])`).
passes/expert_matmuls.py rewrites the three patterns to these ops so that
passes/sharding/rules_experts.py sees one matmul against a parameter. No CUDA kernel: the same torch
ops, under autograd.
"""
from __future__ import annotations

import torch

__all__ = ["gathered_linear", "einsum_linear", "selected_linear"]


def gathered_linear(x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return torch.bmm(x.unsqueeze(1), w[ids]).squeeze(1)        # [S, 1, in] @ [S, in, out] -> [S, out]


def einsum_linear(x: torch.Tensor, w: torch.Tensor, equation: str) -> torch.Tensor:
    """torch.einsum(equation, x, w) for a stacked [experts, in, out] weight: the contracted feature
    last in x's subscripts, the output feature last in the result's (passes/expert_matmuls.py)."""
    return torch.einsum(equation, x, w)


def selected_linear(x: torch.Tensor, w: torch.Tensor, e: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    return torch.nn.functional.linear(x, w[e], bias)
