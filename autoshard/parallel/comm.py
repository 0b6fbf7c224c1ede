"""How collectives reach other ranks: a communicator on a group of the rank's world (world/), a
per-rank handle, and the one switch between a run of rank programs and the lockstep simulator.

Every collective's math is written once over a list of per-rank tensors with a `Reducer`. Under
torch.distributed the list holds this rank's tensor and the reductions are collectives on its
group (`distributed_reducer`); in the simulator it holds every rank's tensor and the reductions
are plain sums, maxima and concatenations (`SIMULATED`). `Collective` is the base of every
collective module: its `forward` takes the first road, its `simulate` the second, so that choice
is made here and nowhere else.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Protocol

import torch
from torch import nn

from autoshard.world import P2P, current
from autoshard.world.protocol import Group

__all__ = ["Communicator", "GroupComm", "CommHandle", "Reducer", "distributed_reducer", "SIMULATED",
           "Collective", "Pending", "write_rows", "scatter_into_full", "take_from_full"]


class Communicator(Protocol):
    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over the tensor-parallel group; returns a new tensor."""

    def all_reduce_max(self, t: torch.Tensor) -> torch.Tensor:
        """Elementwise maximum over the group; returns a new tensor."""

    def reduce_scatter(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """Sum over the group, keeping this rank's equal chunk of `dim`."""

    def all_gather(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """Every rank's equal chunk of `dim`, concatenated in rank order."""

    def all_to_all(self, t: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        """Rows send[j] of `t` (in order) to rank j; the rows received, rank by rank (recv[j] from j)."""

    def shift(self, ts: tuple[torch.Tensor, ...]) -> "Pending":
        """Started: `ts` to the next rank of the group (a ring), the previous rank's received."""

    def size(self) -> int:
        """Ranks in the group."""


class GroupComm:
    """The collectives on a group of this rank's world (world/: torch.distributed in a torchrun job,
    a LocalWorld's rank in one process). `sent_bytes` counts what all_to_all sent to other ranks
    (expert parallelism's traffic)."""

    def __init__(self, group: Group = None):
        self.group = group
        self.world = current()
        self.sent_bytes = 0

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        out = t.contiguous().clone()
        self.world.all_reduce(out, group=self.group)
        return out

    def all_reduce_max(self, t: torch.Tensor) -> torch.Tensor:
        out = t.contiguous().clone()
        self.world.all_reduce(out, op="max", group=self.group)
        return out

    def reduce_scatter(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        x = t.movedim(dim, 0).contiguous()
        out = x.new_empty((x.shape[0] // self.size(), *x.shape[1:]))
        self.world.reduce_scatter(out, x, group=self.group)
        return out.movedim(0, dim)

    def all_gather(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        x = t.movedim(dim, 0).contiguous()
        out = x.new_empty((x.shape[0] * self.size(), *x.shape[1:]))
        self.world.all_gather(out, x, group=self.group)
        return out.movedim(0, dim)

    def all_to_all(self, t: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        t = t.contiguous()
        out = t.new_empty((sum(recv), *t.shape[1:]))
        self.world.all_to_all(out, t, recv, send, group=self.group)
        row = math.prod(t.shape[1:]) * t.element_size()        # a rank may send no rows at all
        self.sent_bytes += row * (sum(send) - send[self.world.rank(self.group)])
        return out

    def size(self) -> int:
        return self.world.size(self.group)

    def shift(self, ts: tuple[torch.Tensor, ...]) -> "Pending":
        n, r = self.size(), self.world.rank(self.group)
        received = tuple(torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in ts)
        nxt, prev = self.world.global_rank(self.group, (r + 1) % n), self.world.global_rank(self.group, (r - 1) % n)
        ops = [P2P(True, t.contiguous(), nxt, group=self.group) for t in ts]
        ops += [P2P(False, t, prev, group=self.group) for t in received]
        return Pending(received, self.world.p2p(ops))


class Pending:
    """Tensors on their way (point-to-point requests); `wait()` returns them once they are here."""

    def __init__(self, value, requests: list = ()):
        self.value, self.requests = value, list(requests)

    def wait(self):
        for req in self.requests:
            req.wait()
        self.requests = []
        return self.value


class CommHandle:
    """The communicator a rank's collectives use; shared by all graphs of one rank, bound when the
    program runs under torch.distributed."""

    def __init__(self, rank: int, world: int = 1):
        self.rank, self.world, self.comm = rank, world, None

    def get(self) -> Communicator:
        if self.comm is None:
            raise RuntimeError(
                f"rank {self.rank}'s program issues collectives but has no process group: run it "
                f"with prog.distributed() inside torchrun or a local world, or use prog.simulate() in one process")
        return self.comm


Ranked = list[torch.Tensor]     # one tensor per rank present: this rank's alone, or every rank's


@dataclass(frozen=True)
class Reducer:
    """Reductions over ranks for a list of per-rank tensors (see the module docstring)."""

    sum: Callable[[Ranked], Ranked]
    max: Callable[[Ranked], Ranked]
    all_gather: Callable[[Ranked, int], Ranked]       # equal chunks along a dim, in rank order
    reduce_scatter: Callable[[Ranked, int], Ranked]   # the sum, each rank keeping its equal chunk of dim
    split: Callable[[Ranked, int], Ranked]            # each rank's own chunk of its (replicated) tensor
    # rows of each rank's tensor sent to the others (sends[i][j]: rows rank i sends to j) -> the rows
    # each received in sender order, and recvs[j][i] (known already: pass them, else exchanged)
    all_to_all: Callable[[Ranked, list[list[int]], list[list[int]] | None], tuple[Ranked, list[list[int]]]]
    # each rank's tuple of tensors to the next rank of the ring, started: `.wait()` -> what each received
    shift: Callable[[list[tuple]], "Pending"]
    group_size: Callable[[int], int]                  # ranks in the group (given the ranks present)


class _AllToAll(torch.autograd.Function):
    """Rows exchanged over a group; backward sends the gradients back the same way reversed."""

    @staticmethod
    def forward(ctx, comm: Communicator, x: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        ctx.args = (comm, send, recv)
        return comm.all_to_all(x, send, recv)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        comm, send, recv = ctx.args
        return None, comm.all_to_all(grad, recv, send), None, None


def distributed_reducer(handle: CommHandle) -> Reducer:
    comm, rank, world = handle.get(), handle.rank, handle.world

    def all_to_all(xs: Ranked, sends: list[list[int]], recvs: list[list[int]] | None):
        if recvs is None:          # each rank tells each other how many rows to expect
            ones = [1] * world
            recvs = [comm.all_to_all(torch.tensor(sends[0]), ones, ones).tolist()]
        return [_AllToAll.apply(comm, xs[0], sends[0], recvs[0])], recvs
    return Reducer(sum=lambda xs: [comm.all_reduce(xs[0])], max=lambda xs: [comm.all_reduce_max(xs[0])],
                   all_gather=lambda xs, d: [comm.all_gather(xs[0], d)],
                   reduce_scatter=lambda xs, d: [comm.reduce_scatter(xs[0], d)],
                   split=lambda xs, d: [xs[0].chunk(world, d)[rank].contiguous()], all_to_all=all_to_all,
                   shift=lambda items: _one(comm.shift(items[0])), group_size=lambda n: comm.size())


def _one(pending: "Pending") -> "Pending":
    """This rank's received tuple, as the list of one a Reducer returns."""
    return Pending([pending.value], pending.requests)


def _dim_major(t: torch.Tensor, d: int) -> torch.Tensor:
    """t laid out as the real collectives return it: dim d outermost in memory (they run on
    t.movedim(d, 0)), so the simulator hands later ops the same strides a real run does."""
    return t.movedim(d, 0).contiguous().movedim(0, d)


def _sim_sum(xs: Ranked) -> Ranked:
    s = sum(xs[1:], xs[0].clone())
    return [s.clone() for _ in xs]


def _sim_max(xs: Ranked) -> Ranked:
    m = torch.stack(xs).amax(0)
    return [m.clone() for _ in xs]


def _sim_all_gather(xs: Ranked, d: int) -> Ranked:
    full = torch.cat(xs, d)
    return [_dim_major(full, d).clone() for _ in xs]      # a buffer per rank, as a real gather gives


def _sim_reduce_scatter(xs: Ranked, d: int) -> Ranked:
    total = sum(xs[1:], xs[0].clone())
    return [_dim_major(c, d) for c in total.chunk(len(xs), d)]


def _sim_all_to_all(xs: Ranked, sends: list[list[int]], recvs: list[list[int]] | None):
    """A permutation of the ranks' rows: rank j receives chunk j of every rank's tensor, in rank order."""
    chunks = [list(x.split(send)) for x, send in zip(xs, sends)]          # chunks[i][j]: from i to j
    outs = [torch.cat([chunks[i][j] for i in range(len(xs))]) for j in range(len(xs))]
    return outs, [[sends[i][j] for i in range(len(xs))] for j in range(len(xs))]


SIMULATED = Reducer(sum=_sim_sum, max=_sim_max, all_gather=_sim_all_gather, reduce_scatter=_sim_reduce_scatter,
                    split=lambda xs, d: [x.chunk(len(xs), d)[i].contiguous() for i, x in enumerate(xs)],
                    all_to_all=_sim_all_to_all,
                    shift=lambda items: Pending([items[(i - 1) % len(items)] for i in range(len(items))]),
                    group_size=lambda n: n)


class Collective(nn.Module):
    """Base of the collective modules a rank graph calls. A subclass writes `run(red, mods,
    rank_args)` once, over the ranks present (`mods[i]` and `rank_args[i]` are rank i's module and
    positional arguments), returning one output per rank."""

    def __init__(self, handle: CommHandle):
        super().__init__()
        self.handle = handle

    @staticmethod
    def run(red: Reducer, mods: list, rank_args: list[tuple]) -> list:
        raise NotImplementedError

    def forward(self, *args: torch.Tensor):
        return self.run(distributed_reducer(self.handle), [self], [args])[0]

    @classmethod
    def simulate(cls, mods: list, rank_args: list[tuple]) -> list:
        """All ranks at once, in one process (compile/simulate.py's lockstep runner calls this)."""
        return cls.run(SIMULATED, mods, rank_args)


def write_rows(full: torch.Tensor, t: torch.Tensor, dim: int, ranges) -> torch.Tensor:
    """Copy a rank's local `t` into the global rows `ranges` of `full` along `dim` (in place)."""
    pos = 0
    for a, b in ranges:
        full.narrow(dim, a, b - a).copy_(t.narrow(dim, pos, b - a))
        pos += b - a
    return full


def scatter_into_full(t: torch.Tensor, dim: int, size: int, ranges) -> torch.Tensor:
    """Zeros of global `size` along `dim`, with this rank's rows (`ranges`) filled from `t`."""
    shape = list(t.shape)
    shape[dim] = size
    return write_rows(t.new_zeros(shape), t, dim, ranges)


def take_from_full(full: torch.Tensor, dim: int, ranges) -> torch.Tensor:
    return torch.cat([full.narrow(dim, a, b - a) for a, b in ranges], dim)
