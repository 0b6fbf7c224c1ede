"""Megatron's conjugate operators f and g, and the gradient sum of rows several ranks hold.

- f: identity forward, all-reduce backward. Sits before a column-parallel matmul: every rank reads
  the same input, so the input's gradient is the sum of every rank's contribution.
- g: all-reduce forward, identity backward. Sits after a row-parallel matmul, whose ranks each hold
  a partial sum.
- sync_replicas: identity forward; backward sums a parameter's gradient over the ranks that hold
  the same rows (grouped-query attention with fewer kv heads than ranks).

Each is a small autograd function over a list of per-rank tensors and a `Collective` module
(comm.py) the rank graphs call by name; `SyncSpec` is what the rewrite emits for a sync module.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from autoshard.parallel.comm import Collective, CommHandle, Reducer, scatter_into_full, take_from_full

__all__ = ["CopyToTensorParallelRegion", "ReduceFromTensorParallelRegion", "SyncReplicatedShard", "SyncSpec"]


class _F(torch.autograd.Function):
    """f: identity forward, all-reduce backward."""

    @staticmethod
    def forward(ctx, red: "Reducer", *xs: torch.Tensor):
        ctx.red = red
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx, *grads):
        return (None, *ctx.red.sum(list(grads)))


class _G(torch.autograd.Function):
    """g: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, red: "Reducer", *xs: torch.Tensor):
        return tuple(red.sum(list(xs)))

    @staticmethod
    def backward(ctx, *grads):
        return (None, *grads)


class _SyncReplicas(torch.autograd.Function):
    """Identity forward; backward sums gradients of rows that several ranks hold."""

    @staticmethod
    def forward(ctx, red: "Reducer", dim: int, size: int, ranges: list, *ws: torch.Tensor):
        ctx.args = (red, dim, size, ranges)
        return tuple(w.view_as(w) for w in ws)

    @staticmethod
    def backward(ctx, *grads):
        red, dim, size, ranges = ctx.args
        fulls = red.sum([scatter_into_full(g, dim, size, r) for g, r in zip(grads, ranges)])
        return (None, None, None, None, *(take_from_full(f, dim, r) for f, r in zip(fulls, ranges)))


class CopyToTensorParallelRegion(Collective):
    """Megatron's f (identity forward, all-reduce backward)."""

    @staticmethod
    def run(red: Reducer, mods: list, rank_args: list[tuple]) -> list[torch.Tensor]:
        return list(_F.apply(red, *(a[0] for a in rank_args)))


class ReduceFromTensorParallelRegion(Collective):
    """Megatron's g (all-reduce forward, identity backward)."""

    @staticmethod
    def run(red: Reducer, mods: list, rank_args: list[tuple]) -> list[torch.Tensor]:
        return list(_G.apply(red, *(a[0] for a in rank_args)))


@dataclass(frozen=True)
class SyncSpec:
    """The rewrite's request for a `SyncReplicatedShard` module named `module`."""

    module: str
    param: str
    dim: int
    size: int
    ranges: tuple[tuple[int, int], ...]     # this rank's rows of the parameter's dim

    def build(self, handle: CommHandle) -> "SyncReplicatedShard":
        return SyncReplicatedShard(handle, self.dim, self.size, self.ranges)


class SyncReplicatedShard(Collective):
    """Sums the gradient of a parameter shard over the ranks holding the same rows."""

    def __init__(self, handle: CommHandle, dim: int, size: int, ranges):
        super().__init__(handle)
        self.dim, self.size, self.ranges = dim, size, tuple(ranges)

    @staticmethod
    def run(red: Reducer, mods: list["SyncReplicatedShard"], rank_args: list[tuple]) -> list[torch.Tensor]:
        m = mods[0]
        return list(_SyncReplicas.apply(red, m.dim, m.size, [k.ranges for k in mods], *(a[0] for a in rank_args)))

    def extra_repr(self) -> str:
        return f"dim={self.dim}, size={self.size}, rows={list(self.ranges)}"
