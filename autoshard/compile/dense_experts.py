"""Experts that loop over the experts hit, exported as the same sum over every expert.

    with dense_experts(model):          # while torch.export traces it
        ...

DBRX's experts run `for expert_idx in expert_hit:`, over the experts that received tokens (found
with nonzero: a loop whose length depends on the routing, which one static graph cannot hold).
Over every expert instead, each expert's MLP runs on every token and is weighted by the token's
routing weight for that expert, zero where the router did not choose it, and the outputs are summed
in expert order. That is the loop's sum: it adds each chosen expert's weighted output to its tokens
(`index_add_`) in the same order, and a token an expert did not receive gets an exact zero from it
(forward and backward: its weight is 0). The matmuls run over all tokens rather than the routed
rows, so results agree to fp32 rounding, not to the bit; and every expert computes every token:
experts / top-k times the loop's expert FLOPs, the price of one static graph (the model's own
forward, run eagerly, still loops).

`DENSE_FORMS` is the table of experts modules this knows: a test on the module and its dense
forward. One row today: an experts module whose `mlp(x, w1, v1, w2)` runs one expert from its
weight slices, stacked as [experts * ffn, hidden] (DBRX).
"""
from __future__ import annotations

import types
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

__all__ = ["DENSE_FORMS", "dense_experts"]


def _is_glu_by_slices(m: nn.Module) -> bool:
    mlp = getattr(m, "mlp", None)
    return isinstance(getattr(m, "num_experts", None), int) and all(
        isinstance(getattr(mlp, w, None), nn.Parameter) for w in ("w1", "v1", "w2")) \
        and hasattr(m, "ffn_hidden_size") and hasattr(m, "hidden_size")


def _glu_by_slices(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                   top_k_weights: torch.Tensor) -> torch.Tensor:
    x = hidden_states.reshape(-1, self.hidden_size)                       # [n, H]
    per_expert = (-1, self.ffn_hidden_size, self.hidden_size)             # [experts, F, H]
    out = torch.zeros_like(x)
    for e in range(self.num_experts):
        weight = (top_k_weights * (top_k_index == e)).sum(-1, keepdim=True)     # [n, 1]: 0 if not chosen
        w1, v1, w2 = (getattr(self.mlp, w).view(per_expert)[e] for w in ("w1", "v1", "w2"))
        out = out + self.mlp(x, w1, v1, w2).view(-1, self.hidden_size) * weight
    return out.view(hidden_states.shape[0], -1, self.hidden_size)


@dataclass(frozen=True)
class DenseForm:
    name: str
    matches: Callable[[nn.Module], bool]
    forward: Callable


DENSE_FORMS = [DenseForm("experts MLP run per expert from weight slices (DBRX)", _is_glu_by_slices, _glu_by_slices)]


@contextmanager
def _patched(module: nn.Module, forward: Callable):
    module.forward = types.MethodType(forward, module)
    try:
        yield
    finally:
        del module.forward


@contextmanager
def dense_experts(model: nn.Module):
    """Every experts module of a DENSE_FORMS row runs its dense forward for the block."""
    with ExitStack() as stack:
        for m in model.modules():
            form = next((f for f in DENSE_FORMS if f.matches(m)), None)
            if form is not None:
                stack.enter_context(_patched(m, form.forward))
        yield
