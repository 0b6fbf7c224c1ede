"""Megatron's conjugate operators as small autograd functions, and the modules graphs call them by.

- f: identity forward, all-reduce backward. Sits before a column-parallel matmul: every rank reads
  the same input, so the input's gradient is the sum of every rank's contribution.
- g: all-reduce forward, identity backward. Sits after a row-parallel matmul, whose ranks each hold
  a partial sum.
- sync_replicas: identity forward; backward sums a parameter's gradient over the ranks that hold
  the same rows (grouped-query attention with fewer kv heads than ranks).

A module holds a `CommHandle`, not a process group: the handle is bound when the program runs
under torch.distributed. Each module's `simulate(mods, rank_args)` runs the same math for every
rank at once, which is how the in-process simulator executes it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["Communicator", "ProcessGroupComm", "CommHandle", "Reducer", "dist_reducer", "sim_reducer",
           "CopyToTensorParallelRegion", "ReduceFromTensorParallelRegion", "SyncReplicatedShard",
           "scatter_into_full", "take_from_full", "write_rows"]


class Communicator(Protocol):
    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over the tensor-parallel group; returns a new tensor."""

    def all_reduce_max(self, t: torch.Tensor) -> torch.Tensor:
        """Elementwise maximum over the group; returns a new tensor."""

    def reduce_scatter(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """Sum over the group, keeping this rank's equal chunk of `dim`."""

    def all_gather(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """Every rank's equal chunk of `dim`, concatenated in rank order."""


class ProcessGroupComm:
    """All-reduce on a torch.distributed process group (gloo on CPU, NCCL on GPU)."""

    def __init__(self, group: dist.ProcessGroup | None = None):
        self.group = group

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        out = t.contiguous().clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=self.group)
        return out

    def all_reduce_max(self, t: torch.Tensor) -> torch.Tensor:
        out = t.contiguous().clone()
        dist.all_reduce(out, op=dist.ReduceOp.MAX, group=self.group)
        return out

    def reduce_scatter(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        x = t.movedim(dim, 0).contiguous()
        out = x.new_empty((x.shape[0] // dist.get_world_size(self.group), *x.shape[1:]))
        dist.reduce_scatter_tensor(out, x, op=dist.ReduceOp.SUM, group=self.group)
        return out.movedim(0, dim)

    def all_gather(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        x = t.movedim(dim, 0).contiguous()
        out = x.new_empty((x.shape[0] * dist.get_world_size(self.group), *x.shape[1:]))
        dist.all_gather_into_tensor(out, x, group=self.group)
        return out.movedim(0, dim)


@dataclass(frozen=True)
class Reducer:
    """Reductions over ranks for a list of per-rank tensors (one tensor per rank present).

    Every collective here is written once over such a list: under torch.distributed the list holds
    this rank's tensor and the reductions are all-reduces on its group; in the simulator it holds
    every rank's tensor and the reductions are plain sums and maxima."""

    sum: Callable[[list[torch.Tensor]], list[torch.Tensor]]
    max: Callable[[list[torch.Tensor]], list[torch.Tensor]]
    gather: Callable[[list[torch.Tensor], int], list[torch.Tensor]]   # equal chunks along a dim, rank order


def dist_reducer(comm: Communicator) -> Reducer:
    return Reducer(sum=lambda xs: [comm.all_reduce(xs[0])], max=lambda xs: [comm.all_reduce_max(xs[0])],
                   gather=lambda xs, d: [comm.all_gather(xs[0], d)])


def sim_reducer() -> Reducer:
    def total(xs):
        s = sum(xs[1:], xs[0].clone())
        return [s.clone() for _ in xs]

    def peak(xs):
        m = torch.stack(xs).amax(0)
        return [m.clone() for _ in xs]

    def gather(xs, d):
        full = torch.cat(xs, d)
        return [full.clone() for _ in xs]
    return Reducer(sum=total, max=peak, gather=gather)


class CommHandle:
    """The communicator a rank's collectives use; shared by all graphs of one rank."""

    def __init__(self, rank: int, world: int = 1):
        self.rank, self.world, self.comm = rank, world, None

    def get(self) -> Communicator:
        if self.comm is None:
            raise RuntimeError(
                f"rank {self.rank}'s program issues collectives but has no process group: run it "
                f"with prog.distributed() inside torchrun, or use prog.simulate() in one process")
        return self.comm


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


def _first_args(rank_args: list[tuple]) -> list[torch.Tensor]:
    return [a[0] for a in rank_args]


class CopyToTensorParallelRegion(nn.Module):
    """Megatron's f (identity forward, all-reduce backward)."""

    def __init__(self, handle: CommHandle):
        super().__init__()
        self.handle = handle

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _F.apply(dist_reducer(self.handle.get()), x)[0]

    @staticmethod
    def simulate(mods: list["CopyToTensorParallelRegion"], rank_args: list[tuple]) -> list[torch.Tensor]:
        return list(_F.apply(sim_reducer(), *_first_args(rank_args)))


class ReduceFromTensorParallelRegion(nn.Module):
    """Megatron's g (all-reduce forward, identity backward)."""

    def __init__(self, handle: CommHandle):
        super().__init__()
        self.handle = handle

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _G.apply(dist_reducer(self.handle.get()), x)[0]

    @staticmethod
    def simulate(mods: list["ReduceFromTensorParallelRegion"], rank_args: list[tuple]) -> list[torch.Tensor]:
        return list(_G.apply(sim_reducer(), *_first_args(rank_args)))


class SyncReplicatedShard(nn.Module):
    """Sums the gradient of a parameter shard over the ranks holding the same rows."""

    def __init__(self, handle: CommHandle, dim: int, size: int, ranges):
        super().__init__()
        self.handle, self.dim, self.size, self.ranges = handle, dim, size, tuple(ranges)

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return _SyncReplicas.apply(dist_reducer(self.handle.get()), self.dim, self.size, [self.ranges], w)[0]

    @staticmethod
    def simulate(mods: list["SyncReplicatedShard"], rank_args: list[tuple]) -> list[torch.Tensor]:
        m = mods[0]
        return list(_SyncReplicas.apply(sim_reducer(), m.dim, m.size, [k.ranges for k in mods],
                                        *_first_args(rank_args)))

    def extra_repr(self) -> str:
        return f"dim={self.dim}, size={self.size}, rows={list(self.ranges)}"
