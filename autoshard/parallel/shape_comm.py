"""A communicator that moves no data: every collective returns a new tensor of the shape, dtype and
layout the real one returns (parallel/comm.py's GroupComm), on the input's device.

It lets one rank's program run alone in one process on meta tensors, as planning/graph_memory.py
does to read the rank's memory off its own graphs: each collective allocates what the real one
allocates, and nothing else; each call is logged (kind, bytes, group size, group kind) for the rank's time
(planning/graph_time.py).
"""
from __future__ import annotations

import torch

from autoshard.parallel.comm import Pending

__all__ = ["ShapeComm"]


class ShapeComm:
    """A group of `size` ranks whose collectives only shape their results (see the module doc)."""

    def __init__(self, size: int, log: list | None = None, group: str = ""):
        if size < 1:
            raise ValueError(f"a group has at least one rank, got size={size}")
        self._size, self.group = size, group
        self.sent_bytes = 0
        # (collective, bytes of its input, group size, the group's kind in the mesh: tp, cp, ep) per call
        self.log = log if log is not None else []

    def _logged(self, kind: str, t: torch.Tensor) -> None:
        self.log.append((kind, t.numel() * t.element_size(), self._size, self.group))

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        self._logged("all_reduce", t)
        return t.contiguous().clone()

    def all_reduce_max(self, t: torch.Tensor) -> torch.Tensor:
        self._logged("all_reduce", t)
        return t.contiguous().clone()

    def reduce_scatter(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        self._logged("reduce_scatter", t)
        x = t.movedim(dim, 0).contiguous()
        if x.shape[0] % self._size:
            raise ValueError(f"reduce_scatter: dim {dim} of size {x.shape[0]} does not divide over {self._size} ranks")
        return x.new_empty((x.shape[0] // self._size, *x.shape[1:])).movedim(0, dim)

    def all_gather(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        self._logged("all_gather", t)
        x = t.movedim(dim, 0).contiguous()
        return x.new_empty((x.shape[0] * self._size, *x.shape[1:])).movedim(0, dim)

    def all_to_all(self, t: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        """Rows from every rank. A tensor with values (the row counts ranks exchange before their
        rows: parallel/comm.py's distributed_reducer) comes back as it went: ranks whose traffic
        is alike (expert parallelism's tokens spread evenly, parallel/expert_parallel.py) receive
        from each rank what they send to it."""
        if t.device.type != "meta":
            return t.clone()
        self._logged("all_to_all", t)
        return t.contiguous().new_empty((sum(recv), *t.shape[1:]))

    def shift(self, ts: tuple[torch.Tensor, ...]) -> Pending:
        for t in ts:
            self._logged("send", t)
        return Pending(tuple(torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in ts))

    def size(self) -> int:
        return self._size
