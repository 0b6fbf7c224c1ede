"""Each parameter's share in the global gradient norm, per tensor-parallel rank.

A gradient element held by k ranks (shared kv-head rows on tensor-parallel ranks, a tied embedding
on two pipeline ranks, a replicated weight on every tp rank) must count once in the norm, so each
holder weighs its square by 1 / k (runtime/gradients.py's global_grad_norm sums them).
"""
from __future__ import annotations

import torch

from autoshard.passes.sharding.annotate import ShardingPlan

__all__ = ["NormWeights"]


class NormWeights:
    def __init__(self, plan: ShardingPlan, param_holders: dict[str, set[int]], param_shapes: dict[str, torch.Size]):
        self.plan, self.param_holders, self.param_shapes = plan, param_holders, param_shapes
        self._cache: dict[tuple[str, int], torch.Tensor | float] = {}    # clipping asks on every step

    def __call__(self, name: str, tp_rank: int) -> torch.Tensor | float:
        """1 / (ranks holding the same element) for rank `tp_rank`'s local gradient of `name`,
        per row (broadcastable) for sharded parameters."""
        if (name, tp_rank) not in self._cache:
            self._cache[(name, tp_rank)] = self._weight(name, tp_rank)
        return self._cache[(name, tp_rank)]

    def _weight(self, name: str, tp_rank: int) -> torch.Tensor | float:
        share = 1.0 / len(self.param_holders.get(name, (0,)))
        use = self.plan.params.get(name)
        if use is None:
            return share / self.plan.tp
        rows = [i for a, b in use.layout[tp_rank] for i in range(a, b)]
        held = torch.zeros(max(b for rs in use.layout for _, b in rs))
        for ranges in use.layout:
            for a, b in ranges:
                held[a:b] += 1
        weight = share / held[rows]
        shape = [1] * len(self.param_shapes[name])
        shape[use.dim] = len(rows)
        return weight.view(shape)
