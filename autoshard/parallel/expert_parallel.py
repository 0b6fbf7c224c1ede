"""Expert parallelism's collective: tokens sent to the ranks that own their experts and back.

    outs = dispatch_combine(red, xs, idxs, ws, run_locals, per_rank)   # per rank: x [n, H], idx / w [n, k]

Written once over the ranks present, like every collective (parallel/comm.py): `red` is the
expert-parallel group's Reducer, whose all-to-all is its world's (world/: torch.distributed's or a local world's;
one rank present) and a permutation of the per-rank lists in the simulator (every rank present).
Each of a rank's n * k (token, slot) pairs goes to its expert's owner (expert e: rank e // per_rank,
`owner_of`) with one all-to-all of uneven splits (dropless: every pair is sent, however unbalanced
the routing); the owner runs `run_local(x_recv [m, H], local ids [m, 1], weights [m, 1])` (the
model's own experts module on its local experts) and a second all-to-all brings each result back to
the pair's rank, where the k results of a token are summed. The all-to-all's backward is the same
exchange with the splits swapped.

    outs = exchange_copies(red, xs, run_locals, per_rank, size)      # per rank: x [experts * n, H]

Experts that each read a copy of every token (Llama 4: the router's score scales the copy, zero
for the experts not chosen, and the model sums the copies after) take one block of n rows per
expert, expert-major. Each owner receives its experts' blocks from every rank (even splits: no
routing decides them), runs the model's module on them expert-major (`run_local(x [per_rank * N, H])`,
N the group's tokens) and sends each rank's rows back.

`ExpertGroup` is one rank's view of its group: its place, the experts each rank owns, its Reducer
(`reducer()`) and the bytes it sent to other ranks (`sent_bytes`, forward and backward).
"""
from __future__ import annotations

from typing import Callable

import torch

from autoshard.parallel.comm import SIMULATED, CommHandle, GroupComm, Reducer, distributed_reducer
from autoshard.world import Group

__all__ = ["ExpertGroup", "RunLocal", "dispatch_combine", "exchange_copies", "owner_of"]

RunLocal = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class ExpertGroup:
    """Rank `rank` of an expert-parallel group of `size` ranks, each owning `per_rank` consecutive
    experts. With a process group its exchanges are collectives on it; without one they are the
    simulator's (every rank of the group in one process, or a group of one)."""

    def __init__(self, group: Group, rank: int, size: int, per_rank: int):
        self.group, self.rank, self.size, self.per_rank = group, rank, size, per_rank
        self.handle = CommHandle(rank, size)
        self.handle.comm = GroupComm(group) if group is not None else None

    def reducer(self) -> Reducer:
        return SIMULATED if self.handle.comm is None else distributed_reducer(self.handle)

    @property
    def sent_bytes(self) -> int:
        """Payload this rank sent to the other ranks so far (0 when simulated)."""
        return getattr(self.handle.comm, "sent_bytes", 0)

    def __repr__(self) -> str:
        return f"ExpertGroup(rank={self.rank}, size={self.size}, per_rank={self.per_rank})"


def owner_of(flat_ids: torch.Tensor, per_rank: int) -> torch.Tensor:
    """The rank owning each expert id: experts are laid out per_rank at a time, in rank order."""
    return torch.div(flat_ids, per_rank, rounding_mode="floor")


def _pairs_per_owner(owner: torch.Tensor, size: int) -> list[int]:
    """How many of the pairs go to each rank. A meta tensor (a rank's memory read on shapes alone:
    planning/graph_memory.py) has no expert ids: its pairs are spread evenly, as a balanced router
    spreads them."""
    if owner.device.type == "meta":
        even, extra = divmod(owner.numel(), size)
        return [even + (r < extra) for r in range(size)]
    return torch.bincount(owner, minlength=size).tolist()


def dispatch_combine(red: Reducer, xs: list[torch.Tensor], idxs: list[torch.Tensor], ws: list[torch.Tensor],
                     run_locals: list[RunLocal], per_rank: int, size: int, per_source: bool = False) -> list[torch.Tensor]:
    """The experts' output for each present rank's tokens, computed by the experts' owners (see above).
    `per_source`: an owner runs each source rank's pairs as a call of their own (FP8 experts: each
    call's scales are then those of one rank's tokens, as on one device for its microbatch)."""
    plans = []
    for idx in idxs:
        flat = idx.reshape(-1)                                   # [n * k] expert of each (token, slot)
        owner = owner_of(flat, per_rank)
        order = torch.argsort(owner, stable=True)                # pairs grouped by owner rank
        rows = torch.div(order, idx.shape[1], rounding_mode="floor")      # the token of each sent pair
        send = _pairs_per_owner(owner, size)                     # [size] pairs per owner
        plans.append((flat, owner, order, rows, send))
    sends = [p[4] for p in plans]
    local_ids, recvs = red.all_to_all([(flat - owner * per_rank)[order]
                                       for flat, owner, order, _, _ in plans], sends, None)   # [m], no gradient
    x_in, _ = red.all_to_all([x[p[3]] for x, p in zip(xs, plans)], sends, recvs)            # [m, H]
    w_in, _ = red.all_to_all([w.reshape(-1)[p[2]] for w, p in zip(ws, plans)], sends, recvs)  # [m]
    if per_source:
        ys = [_per_source(run, xi, ids, wi, recv) for run, xi, ids, wi, recv in zip(run_locals, x_in, local_ids, w_in,
                                                                                 recvs)]
    else:
        ys = [run(xi, ids[:, None], wi[:, None]) for run, xi, ids, wi in zip(run_locals, x_in, local_ids, w_in)]
    back, _ = red.all_to_all(ys, recvs, sends)                  # [n * k, H] each, in `order`'s order
    return [torch.zeros((x.shape[0], x.shape[-1]), dtype=b.dtype, device=b.device).index_add(0, p[3], b)
            for x, p, b in zip(xs, plans, back)]


def _per_source(run: RunLocal, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, recv: list[int]) -> torch.Tensor:
    """run() on each source rank's received rows (`recv[j]` from rank j, in rank order) apart; a rank
    that sent none is skipped, unless none sent any (then one call on no rows: the experts' weights
    still get their zero gradients)."""
    parts = [(xj, ij, wj) for xj, ij, wj in zip(x.split(recv), ids.split(recv), w.split(recv)) if xj.shape[0]]
    outs = [run(xj, ij[:, None], wj[:, None]) for xj, ij, wj in parts or [(x, ids, w)]]
    return torch.cat(outs)


def exchange_copies(red: Reducer, xs: list[torch.Tensor], run_locals: list[Callable[[torch.Tensor], torch.Tensor]],
                    per_rank: int, size: int) -> list[torch.Tensor]:
    """The experts' output for each present rank's copies x [experts * n, H] (see above)."""
    width = xs[0].shape[-1]
    sends = [[per_rank * (x.shape[0] // (per_rank * size))] * size for x in xs]
    x_in, recvs = red.all_to_all(list(xs), sends, None)       # [per_rank * N, H], source rank major
    ys = []
    for x, recv, run in zip(x_in, recvs, run_locals):
        tokens = [r // per_rank for r in recv]                 # n of each source rank
        blocks = [b.view(per_rank, n, width) for b, n in zip(x.split(recv), tokens)]
        out = run(torch.cat(blocks, dim=1).reshape(-1, width)).view(per_rank, sum(tokens), width)
        ys.append(torch.cat([part.reshape(-1, width) for part in out.split(tokens, dim=1)]))
    back, _ = red.all_to_all(ys, recvs, sends)                 # each rank's [experts * n, H], expert order
    return back
