"""The view of the graph that op rules get: placements of arguments, shapes, parameters, roots."""
from __future__ import annotations

from typing import Protocol

import sympy
import torch.fx as fx

from .index_sets import Layout
from .placement import Origin, Placement

__all__ = ["RuleContext"]


class RuleContext(Protocol):
    tp: int

    def place(self, arg: object) -> Placement: ...
    def shape(self, node: fx.Node) -> list[sympy.Expr]: ...
    def param(self, arg: object) -> tuple[str, bool] | None:
        """(parameter name, transposed) when `arg` reads a parameter directly or through t()."""
    def root_layout(self, node: fx.Node, size: int) -> Layout | None:
        """Layout for a column-parallel root, or None when it cannot be one (pinned, indivisible)."""
    def require_cuts(self, origin: Origin | None, cuts: list[int], scale_size: int, roots: frozenset[str],
                     reason: str) -> None:
        """Ask that the root's layout be cut at these positions of the value's sharded dim."""
    def require_granularity(self, origin: Origin | None, size: int, granularity: int,
                            roots: frozenset[str], reason: str) -> None:
        """Ask that the root's layout be made of whole blocks of `granularity` of this value's dim."""
    def prefers_unit_outer(self, node: fx.Node) -> bool:
        """Whether this reshape should put the shard on a leading size-1 dim (one kv head)."""
    def note_alternative(self, node: fx.Node, roots: frozenset[str]) -> None:
        """This reshape could also read the other way; try that before abandoning `roots`."""
    def where(self, node: fx.Node) -> str:
        """'node view_3 (module transformer.h.0.attn)' for messages."""
