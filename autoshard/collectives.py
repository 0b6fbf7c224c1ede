"""Megatron's conjugate operators as small autograd functions, and the modules graphs call them by.

- f: identity forward, all-reduce backward. Sits before a column-parallel matmul: every rank reads
  the same input, so the input's gradient is the sum of every rank's contribution.
- g: all-reduce forward, identity backward. Sits after a row-parallel matmul, whose ranks each hold
  a partial sum.
- sync_replicas: identity forward; backward sums a parameter's gradient over the ranks that hold
  the same rows (grouped-query attention with fewer kv heads than ranks).

A module holds a `CommHandle`, not a process group: the handle is bound when the program runs
under torch.distributed, and the in-process simulator replaces these calls with its own.
"""
from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["Communicator", "ProcessGroupComm", "CommHandle", "CopyToTensorParallelRegion",
           "ReduceFromTensorParallelRegion", "SyncReplicatedShard", "COLLECTIVE_MODULES",
           "scatter_into_full", "take_from_full"]


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
    def forward(ctx, x: torch.Tensor, comm: Communicator) -> torch.Tensor:
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.comm.all_reduce(grad), None


class _G(torch.autograd.Function):
    """g: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Communicator) -> torch.Tensor:
        return comm.all_reduce(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def scatter_into_full(t: torch.Tensor, dim: int, size: int, ranges) -> torch.Tensor:
    """Zeros of global `size` along `dim`, with this rank's rows (`ranges`) filled from `t`."""
    shape = list(t.shape)
    shape[dim] = size
    full = t.new_zeros(shape)
    pos = 0
    for a, b in ranges:
        full.narrow(dim, a, b - a).copy_(t.narrow(dim, pos, b - a))
        pos += b - a
    return full


def take_from_full(full: torch.Tensor, dim: int, ranges) -> torch.Tensor:
    return torch.cat([full.narrow(dim, a, b - a) for a, b in ranges], dim)


class _SyncReplicas(torch.autograd.Function):
    """Identity forward; backward sums gradients of rows that several ranks hold."""

    @staticmethod
    def forward(ctx, w: torch.Tensor, comm: Communicator, dim: int, size: int, ranges) -> torch.Tensor:
        ctx.args = (comm, dim, size, ranges)
        return w.view_as(w)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        comm, dim, size, ranges = ctx.args
        full = comm.all_reduce(scatter_into_full(grad, dim, size, ranges))
        return take_from_full(full, dim, ranges), None, None, None, None


class CopyToTensorParallelRegion(nn.Module):
    """Megatron's f (identity forward, all-reduce backward)."""

    def __init__(self, handle: CommHandle):
        super().__init__()
        self.handle = handle

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _F.apply(x, self.handle.get())


class ReduceFromTensorParallelRegion(nn.Module):
    """Megatron's g (all-reduce forward, identity backward)."""

    def __init__(self, handle: CommHandle):
        super().__init__()
        self.handle = handle

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _G.apply(x, self.handle.get())


class SyncReplicatedShard(nn.Module):
    """Sums the gradient of a parameter shard over the ranks holding the same rows."""

    def __init__(self, handle: CommHandle, dim: int, size: int, ranges):
        super().__init__()
        self.handle, self.dim, self.size, self.ranges = handle, dim, size, tuple(ranges)

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return _SyncReplicas.apply(w, self.handle.get(), self.dim, self.size, self.ranges)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, size={self.size}, rows={list(self.ranges)}"


COLLECTIVE_MODULES = (CopyToTensorParallelRegion, ReduceFromTensorParallelRegion, SyncReplicatedShard)
