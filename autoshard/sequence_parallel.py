"""Sequence-parallel collectives (Korthikanti et al. 2022), by the names Megatron gives them.

- reduce_scatter_to_sequence_parallel_region: partial sums in, this rank's tokens of the sum out
  (forward reduce-scatter, backward all-gather). Ends a tensor-parallel region.
- gather_from_sequence_parallel_region: this rank's tokens in, every token out (forward all-gather,
  backward reduce-scatter). Starts one.

Together they move what one all-reduce moves, so sequence parallelism costs the same communication
as plain tensor parallelism. Tokens are `outer` tiles of a dim whose each tile is split evenly over
the ranks: outer=1 is a [B, T, C] tensor split along T; outer=B is GPT-2's flattened [B*T, C]. Both
are viewed so that the split dim holds contiguous, equal chunks, which the primitives want.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from .collectives import CommHandle

__all__ = ["SeqOps", "dist_seq_ops", "sim_seq_ops", "ReduceScatterToSequenceParallelRegion",
           "GatherFromSequenceParallelRegion", "seq_reduce_scatter", "seq_all_gather"]


def _split_view(x: torch.Tensor, dim: int, outer: int) -> torch.Tensor:
    """[.., outer*n, ..] -> [.., outer, n, ..]: the chunked dim becomes dim + 1 when outer > 1."""
    if outer == 1:
        return x
    shape = list(x.shape)
    return x.reshape(shape[:dim] + [outer, shape[dim] // outer] + shape[dim + 1:])


def _merge_view(x: torch.Tensor, dim: int, outer: int) -> torch.Tensor:
    if outer == 1:
        return x
    shape = list(x.shape)
    return x.reshape(shape[:dim] + [shape[dim] * shape[dim + 1]] + shape[dim + 2:])


@dataclass(frozen=True)
class SeqOps:
    """Reduce-scatter and all-gather along a dim of equal contiguous chunks, over a list of ranks."""

    reduce_scatter: Callable[[list[torch.Tensor], int], list[torch.Tensor]]
    all_gather: Callable[[list[torch.Tensor], int], list[torch.Tensor]]
    split: Callable[[list[torch.Tensor], int], list[torch.Tensor]]     # each rank's own chunk


def dist_seq_ops(comm, rank: int, world: int) -> SeqOps:
    return SeqOps(reduce_scatter=lambda xs, d: [comm.reduce_scatter(xs[0], d)],
                  all_gather=lambda xs, d: [comm.all_gather(xs[0], d)],
                  split=lambda xs, d: [xs[0].chunk(world, d)[rank].contiguous()])


def _dim_major(t: torch.Tensor, d: int) -> torch.Tensor:
    """t laid out as the real collectives return it: dim d outermost in memory (they run on
    t.movedim(d, 0)), so the simulator hands later ops the same strides a real run does."""
    return t.movedim(d, 0).contiguous().movedim(0, d)


def sim_seq_ops() -> SeqOps:
    def rs(xs, d):
        total = sum(xs[1:], xs[0].clone())
        return [_dim_major(c, d) for c in total.chunk(len(xs), d)]

    def ag(xs, d):
        full = torch.cat(xs, d)
        return [_dim_major(full, d) for _ in xs]
    return SeqOps(reduce_scatter=rs, all_gather=ag,
                  split=lambda xs, d: [x.chunk(len(xs), d)[i].contiguous() for i, x in enumerate(xs)])


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ops: SeqOps, dim: int, outer: int, *xs: torch.Tensor):
        ctx.args = (ops, dim, outer)
        d = dim + (outer > 1)
        return tuple(_merge_view(y, dim, outer) for y in ops.reduce_scatter([_split_view(x, dim, outer) for x in xs], d))

    @staticmethod
    def backward(ctx, *grads):
        ops, dim, outer = ctx.args
        d = dim + (outer > 1)
        full = ops.all_gather([_split_view(g, dim, outer) for g in grads], d)
        return (None, None, None, *(_merge_view(y, dim, outer) for y in full))


class _AllGather(torch.autograd.Function):
    """Backward reduce-scatters when the ranks computed different things from the gathered tokens
    (a column-parallel block); when they computed the same (a replicated layer), every rank already
    holds the whole gradient and keeps its own chunk (Megatron's tensor_parallel_output_grad)."""

    @staticmethod
    def forward(ctx, ops: SeqOps, dim: int, outer: int, reduce_grads: bool, *xs: torch.Tensor):
        ctx.args = (ops, dim, outer, reduce_grads)
        d = dim + (outer > 1)
        return tuple(_merge_view(y, dim, outer) for y in ops.all_gather([_split_view(x, dim, outer) for x in xs], d))

    @staticmethod
    def backward(ctx, *grads):
        ops, dim, outer, reduce_grads = ctx.args
        d = dim + (outer > 1)
        back = ops.reduce_scatter if reduce_grads else ops.split
        part = back([_split_view(g, dim, outer) for g in grads], d)
        return (None, None, None, None, *(_merge_view(y, dim, outer) for y in part))


def seq_reduce_scatter(ops: SeqOps, dim: int, outer: int, xs: list[torch.Tensor]) -> list[torch.Tensor]:
    return list(_ReduceScatter.apply(ops, dim, outer, *xs))


def seq_all_gather(ops: SeqOps, dim: int, outer: int, xs: list[torch.Tensor],
                   reduce_grads: bool = True) -> list[torch.Tensor]:
    return list(_AllGather.apply(ops, dim, outer, reduce_grads, *xs))


class ReduceScatterToSequenceParallelRegion(nn.Module):
    """Partial sums in, this rank's tokens of their sum out (backward: all-gather)."""

    def __init__(self, handle: CommHandle, dim: int, outer: int):
        super().__init__()
        self.handle, self.dim, self.outer = handle, dim, outer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = dist_seq_ops(self.handle.get(), self.handle.rank, self.handle.world)
        return seq_reduce_scatter(ops, self.dim, self.outer, [x])[0]

    @staticmethod
    def simulate(mods: list["ReduceScatterToSequenceParallelRegion"], rank_args: list[tuple]) -> list[torch.Tensor]:
        return seq_reduce_scatter(sim_seq_ops(), mods[0].dim, mods[0].outer, [a[0] for a in rank_args])

    def extra_repr(self) -> str:
        return f"dim={self.dim}, tiles={self.outer}"


class GatherFromSequenceParallelRegion(nn.Module):
    """This rank's tokens in, all tokens out (backward: reduce-scatter)."""

    def __init__(self, handle: CommHandle, dim: int, outer: int, reduce_grads: bool = True):
        super().__init__()
        self.handle, self.dim, self.outer, self.reduce_grads = handle, dim, outer, reduce_grads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = dist_seq_ops(self.handle.get(), self.handle.rank, self.handle.world)
        return seq_all_gather(ops, self.dim, self.outer, [x], self.reduce_grads)[0]

    @staticmethod
    def simulate(mods: list["GatherFromSequenceParallelRegion"], rank_args: list[tuple]) -> list[torch.Tensor]:
        m = mods[0]
        return seq_all_gather(sim_seq_ops(), m.dim, m.outer, [a[0] for a in rank_args], m.reduce_grads)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, tiles={self.outer}, reduce_grads={self.reduce_grads}"
