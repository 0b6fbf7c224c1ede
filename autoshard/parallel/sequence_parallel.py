"""Sequence-parallel collectives (Korthikanti et al. 2022), by the names Megatron gives them.

- reduce_scatter_to_sequence_parallel_region: partial sums in, this rank's tokens of the sum out
  (forward reduce-scatter, backward all-gather). Ends a tensor-parallel region.
- gather_from_sequence_parallel_region: this rank's tokens in, every token out (forward all-gather,
  backward reduce-scatter). Starts one.

Together they move what one all-reduce moves, so sequence parallelism costs the same communication
as plain tensor parallelism. Tokens are `outer` tiles of a dim whose each tile is split evenly over
the ranks: outer=1 is a [B, T, C] tensor split along T; outer=B is GPT-2's flattened [B*T, C]. Both
are viewed so that the split dim holds contiguous, equal chunks, which the primitives want.
`SequenceSpec` is what the rewrite emits for either module.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from autoshard.parallel.comm import Collective, CommHandle, Reducer

__all__ = ["ReduceScatterToSequenceParallelRegion", "GatherFromSequenceParallelRegion", "SequenceSpec",
           "seq_reduce_scatter", "seq_all_gather"]


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


def _owned(y: torch.Tensor) -> torch.Tensor:
    """A collective's output as a tensor of its own, not a view: the graph may update it in place
    (Falcon's parallel attention adds the MLP's reduce-scattered output into the attention's with
    add_), which autograd refuses on a custom function's view outputs. No copy: the buffer is the
    collective's own (the simulator's all-gather gives each rank a buffer of its own too)."""
    return y.detach()


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ops: Reducer, dim: int, outer: int, *xs: torch.Tensor):
        ctx.args = (ops, dim, outer)
        d = dim + (outer > 1)
        return tuple(_owned(_merge_view(y, dim, outer))
                     for y in ops.reduce_scatter([_split_view(x, dim, outer) for x in xs], d))

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
    def forward(ctx, ops: Reducer, dim: int, outer: int, reduce_grads: bool, *xs: torch.Tensor):
        ctx.args = (ops, dim, outer, reduce_grads)
        d = dim + (outer > 1)
        return tuple(_owned(_merge_view(y, dim, outer))
                     for y in ops.all_gather([_split_view(x, dim, outer) for x in xs], d))

    @staticmethod
    def backward(ctx, *grads):
        ops, dim, outer, reduce_grads = ctx.args
        d = dim + (outer > 1)
        back = ops.reduce_scatter if reduce_grads else ops.split
        part = back([_split_view(g, dim, outer) for g in grads], d)
        return (None, None, None, None, *(_merge_view(y, dim, outer) for y in part))


def seq_reduce_scatter(ops: Reducer, dim: int, outer: int, xs: list[torch.Tensor]) -> list[torch.Tensor]:
    return list(_ReduceScatter.apply(ops, dim, outer, *xs))


def seq_all_gather(ops: Reducer, dim: int, outer: int, xs: list[torch.Tensor],
                   reduce_grads: bool = True) -> list[torch.Tensor]:
    return list(_AllGather.apply(ops, dim, outer, reduce_grads, *xs))


@dataclass(frozen=True)
class SequenceSpec:
    """The rewrite's request for a sequence-parallel module named `module`, along `dim` in `outer`
    tiles: "reduce_scatter", "all_gather", or "all_gather_keep_grad" (for a replicated consumer:
    backward keeps the local chunk)."""

    module: str
    kind: str
    dim: int
    outer: int

    def build(self, handle: CommHandle) -> Collective:
        if self.kind == "reduce_scatter":
            return ReduceScatterToSequenceParallelRegion(handle, self.dim, self.outer)
        return GatherFromSequenceParallelRegion(handle, self.dim, self.outer, self.kind == "all_gather")


class ReduceScatterToSequenceParallelRegion(Collective):
    """Partial sums in, this rank's tokens of their sum out (backward: all-gather)."""

    def __init__(self, handle: CommHandle, dim: int, outer: int):
        super().__init__(handle)
        self.dim, self.outer = dim, outer

    @staticmethod
    def run(red: Reducer, mods: list["ReduceScatterToSequenceParallelRegion"], rank_args: list[tuple]) -> list[torch.Tensor]:
        return seq_reduce_scatter(red, mods[0].dim, mods[0].outer, [a[0] for a in rank_args])

    def extra_repr(self) -> str:
        return f"dim={self.dim}, tiles={self.outer}"


class GatherFromSequenceParallelRegion(Collective):
    """This rank's tokens in, all tokens out (backward: reduce-scatter)."""

    def __init__(self, handle: CommHandle, dim: int, outer: int, reduce_grads: bool = True):
        super().__init__(handle)
        self.dim, self.outer, self.reduce_grads = dim, outer, reduce_grads

    @staticmethod
    def run(red: Reducer, mods: list["GatherFromSequenceParallelRegion"], rank_args: list[tuple]) -> list[torch.Tensor]:
        m = mods[0]
        return seq_all_gather(red, m.dim, m.outer, [a[0] for a in rank_args], m.reduce_grads)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, tiles={self.outer}, reduce_grads={self.reduce_grads}"
