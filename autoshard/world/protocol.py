"""What a world offers a rank: groups, collectives, point-to-point transfers with handles, and a
barrier (world/__init__.py says which worlds implement it).

Semantics are torch.distributed's, so that its implementation is a thin wrapper and code reads
the same on every world: tensors are written in place, a group is made by every rank in the same
order (`new_group`), `None` is the whole world, collectives split and concatenate along dim 0, and
an `async_op=True` call returns a `Work` whose `wait()` returns once the result is in place.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

__all__ = ["World", "Work", "Group", "P2P", "DONE"]

Group = Any          # a world's group object (a torch ProcessGroup, a LocalGroup); None: every rank


class Work(Protocol):
    def wait(self) -> Any: ...
    def is_completed(self) -> bool: ...


class _Done:
    """A Work that finished when it was made (a send into a mailbox, a collective of one rank)."""

    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


DONE = _Done()


@dataclass(frozen=True)
class P2P:
    """One point-to-point operation of a batch: send `tensor` to, or receive into it from, global
    rank `peer`; `tag` pairs a send with its receive (in order, among equal tags)."""
    send: bool
    tensor: torch.Tensor
    peer: int
    tag: int = 0
    group: Group = None


class World(Protocol):
    backend: str          # "gloo", "nccl", "local" or "shapes"

    def rank(self, group: Group = None) -> int:
        """This rank's place in `group` (global rank with None)."""

    def size(self, group: Group = None) -> int:
        """Ranks in `group` (the world's with None)."""

    def global_rank(self, group: Group, group_rank: int) -> int:
        """The global rank of `group`'s rank `group_rank`."""

    def new_group(self, ranks: list[int]) -> Group:
        """A group of `ranks`; every rank makes every group, in the same order."""

    def all_reduce(self, t: torch.Tensor, op: str = "sum", group: Group = None, async_op: bool = False) -> Work | None:
        """`t` becomes the elementwise sum ("sum") or maximum ("max") over the group."""

    def reduce_scatter(self, out: torch.Tensor, t: torch.Tensor, group: Group = None,
                       async_op: bool = False) -> Work | None:
        """`out` becomes this rank's equal dim-0 chunk of the sum of every rank's `t`."""

    def all_gather(self, out: torch.Tensor, t: torch.Tensor, group: Group = None,
                   async_op: bool = False) -> Work | None:
        """`out` becomes every rank's `t` concatenated along dim 0, in rank order."""

    def all_to_all(self, out: torch.Tensor, t: torch.Tensor, out_splits: list[int], in_splits: list[int],
                   group: Group = None) -> None:
        """Rows in_splits[j] of `t` (in order) go to rank j; `out` holds the rows received, rank by rank."""

    def broadcast(self, t: torch.Tensor, src: int, group: Group = None) -> None:
        """`t` becomes global rank `src`'s."""

    def p2p(self, ops: list[P2P]) -> list[Work]:
        """Start every operation of `ops`; one Work per operation."""

    def barrier(self, group: Group = None) -> None:
        """Return once every rank of the group has called it."""

    def gather_objects(self, obj: Any, group: Group = None) -> list:
        """Every rank's `obj` (picklable), in rank order."""

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Global rank `src`'s `obj`, on every rank."""
