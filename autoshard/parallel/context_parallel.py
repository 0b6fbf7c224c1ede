"""Context parallelism's pieces: which tokens a rank holds, and the key/value all-gather.

Every rank of a context-parallel group of `cp` ranks holds 1/cp of each sequence's tokens, cut in
2 * cp equal pieces of which rank r holds pieces r and 2 * cp - 1 - r (load-balanced causal
chunks: under a causal mask piece i attends to i + 1 pieces, so each rank's pair costs the same
2 * cp + 1 pieces of work). `context_positions` gives those tokens' global positions.

`GatherFromContextParallelRegion` is the attention's exchange: this rank's keys (or values) in,
every token's keys out in the sequence's own order (forward all-gather, then the permutation from
rank order to position order; backward the permutation back, then reduce-scatter: each rank's
queries contributed to every key's gradient). `ContextGatherSpec` is what passes/context_parallel.py
emits for one.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from autoshard.errors import ShardingError
from autoshard.parallel.comm import Collective, CommHandle, Reducer
from autoshard.parallel.sequence_parallel import seq_all_gather

__all__ = ["context_positions", "rank_order", "ContextCollective", "GatherFromContextParallelRegion",
           "ContextGatherSpec", "context_groups"]


def _pieces(seq: int, cp: int) -> int:
    if seq % (2 * cp):
        raise ShardingError(f"context parallelism cuts each sequence in 2 * cp = {2 * cp} equal pieces, but the "
                            f"sequence has {seq} tokens: pad it to a multiple of {2 * cp}")
    return seq // (2 * cp)


def context_positions(seq: int, cp: int, rank: int, device: torch.device | str | None = None) -> torch.Tensor:
    """The global positions (ascending) of context-parallel rank `rank`'s tokens of a `seq`-token
    sequence: pieces rank and 2 * cp - 1 - rank of 2 * cp."""
    piece = _pieces(int(seq), cp)
    first = torch.arange(rank * piece, (rank + 1) * piece, device=device)
    last = torch.arange((2 * cp - 1 - rank) * piece, (2 * cp - rank) * piece, device=device)
    return torch.cat([first, last])


def rank_order(seq: int, cp: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Where each global position sits among the ranks' tokens concatenated in rank order (what an
    all-gather returns): `gathered.index_select(dim, rank_order(...))` is in position order."""
    held = torch.cat([context_positions(seq, cp, r, device) for r in range(cp)])    # (seq,) position at each slot
    return torch.argsort(held)


def context_groups(tp_groups: list[list[int]], cp: int) -> list[list[int]]:
    """The simulator's ranks are data rank major (data rank d's tensor-parallel ranks are
    `tp_groups[d]`; d = replica * cp + context-parallel rank): context-parallel group (g, t) is
    tensor-parallel rank t of batch replica g's cp data ranks."""
    return [list(group) for g in range(0, len(tp_groups), cp) for group in zip(*tp_groups[g:g + cp])]


class ContextCollective(Collective):
    """Base of the collectives over the context-parallel group: in the simulator they span the
    tensor-parallel groups (`spans_groups`), meeting the same tensor-parallel rank of each replica."""

    spans_groups = True

    def __init__(self, handle: CommHandle, cp: int):
        super().__init__(handle)
        self.cp = cp

    @classmethod
    def simulate(cls, mods: list, rank_args: list[tuple], groups: list[list[int]] | None = None) -> list:
        outs: list = [None] * len(mods)
        for group in context_groups(groups, mods[0].cp) if groups is not None else [list(range(len(mods)))]:
            for i, o in zip(group, super().simulate([mods[i] for i in group], [rank_args[i] for i in group])):
                outs[i] = o
        return outs


class GatherFromContextParallelRegion(ContextCollective):
    """This rank's tokens in, every token out in position order (forward all-gather, backward
    reduce-scatter), over the context-parallel group."""

    def __init__(self, handle: CommHandle, dim: int, cp: int):
        super().__init__(handle, cp)
        self.dim = dim

    @staticmethod
    def run(red: Reducer, mods: list["GatherFromContextParallelRegion"], rank_args: list[tuple]) -> list[torch.Tensor]:
        m = mods[0]
        xs = [a[0] for a in rank_args]
        full = seq_all_gather(red, m.dim, 1, xs)          # (.., seq, ..) in rank order
        order = rank_order(full[0].shape[m.dim], m.cp, full[0].device)
        return [f.index_select(m.dim, order) for f in full]

    def extra_repr(self) -> str:
        return f"dim={self.dim}, cp={self.cp}"


@dataclass(frozen=True)
class ContextGatherSpec:
    """The context-parallel pass's request for a key/value gather named `module` along `dim`."""

    module: str
    dim: int
    cp: int

    def build(self, handle: CommHandle) -> GatherFromContextParallelRegion:
        return GatherFromContextParallelRegion(handle, self.dim, self.cp)
