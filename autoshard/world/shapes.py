"""A world for one rank run alone on meta tensors: the planner's walk of a training step
(planning/meta_step.py runs the runtime's own MeshRuntime and Transfer in it).

Its tensors hold shapes, not values, so its collectives change nothing and complete at once, as
does a send. A receive's buffer is already shaped by its receiver; where the receiver needs a value
from the message itself (a pipeline header: the shapes of a stage's inputs), `answer(op)` writes what
the sending rank would have sent.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from autoshard.world.protocol import DONE, P2P, Work

__all__ = ["ShapeWorld"]


class ShapeWorld:
    """Rank `me` of a world of `size` ranks, run alone (module doc). Groups are tuples of ranks."""

    backend = "shapes"

    def __init__(self, size: int, me: int, answer: Callable[[P2P], None] | None = None):
        self.world_size, self.me, self.answer = size, me, answer

    def rank(self, group: tuple[int, ...] | None = None) -> int:
        return self.me if group is None else group.index(self.me)

    def size(self, group: tuple[int, ...] | None = None) -> int:
        return self.world_size if group is None else len(group)

    def global_rank(self, group: tuple[int, ...] | None, group_rank: int) -> int:
        return group_rank if group is None else group[group_rank]

    def new_group(self, ranks: list[int]) -> tuple[int, ...]:
        return tuple(ranks)

    def _done(self, async_op: bool) -> Work | None:
        return DONE if async_op else None

    def all_reduce(self, t: torch.Tensor, op: str = "sum", group=None, async_op: bool = False) -> Work | None:
        return self._done(async_op)

    def reduce_scatter(self, out: torch.Tensor, t: torch.Tensor, group=None, async_op: bool = False) -> Work | None:
        return self._done(async_op)

    def all_gather(self, out: torch.Tensor, t: torch.Tensor, group=None, async_op: bool = False) -> Work | None:
        return self._done(async_op)

    def all_to_all(self, out: torch.Tensor, t: torch.Tensor, out_splits: list[int], in_splits: list[int],
                   group=None) -> None:
        return None

    def broadcast(self, t: torch.Tensor, src: int, group=None) -> None:
        return None

    def p2p(self, ops: list[P2P]) -> list[Work]:
        for o in ops:
            if not o.send and self.answer is not None:
                self.answer(o)
        return [DONE] * len(ops)

    def barrier(self, group=None) -> None:
        return None

    def gather_objects(self, obj: Any, group=None) -> list:
        return [obj] * self.size(group)

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        return obj
