"""The view of the graph that op rules get: placements of arguments, shapes, parameters, roots."""
from __future__ import annotations

from typing import NoReturn, Protocol

import sympy
import torch.fx as fx

from autoshard.passes.sharding.index_sets import Layout
from autoshard.passes.sharding.options import ShardOptions
from autoshard.passes.sharding.placement import Fallback, Origin, Placement, ReadSplit, Shard

__all__ = ["RuleContext"]


class RuleContext(Protocol):
    tp: int
    options: ShardOptions

    def place(self, arg: object) -> Placement: ...
    def shape(self, node: fx.Node) -> list[sympy.Expr]: ...
    def param(self, arg: object) -> tuple[str, bool] | None:
        """(parameter name, transposed) when `arg` reads a parameter directly or through t()."""
    def root_layout(self, node: fx.Node, size: int, weight: tuple[str, int] | None = None
                    ) -> tuple[Layout, int | None] | None:
        """(layout, padded size or None) for a column-parallel root; None when it cannot be one.
        A weight (name, dim) already split on that dim (a tied embedding) keeps its layout."""
    def note_tokens(self, node: fx.Node, x: fx.Node, p: Shard) -> None:
        """Column root `node` gathers its input `x` from sequence shards `p`."""
    def tokens_for(self, node: fx.Node, roots: frozenset[str]) -> "tuple[int, Shard] | None":
        """(dim, sequence placement) a row-parallel output of these roots can be scattered onto."""
    def split_read(self, node: fx.Node) -> ReadSplit | None:
        """How a consumer asked this gather of parameter rows to read the parameter split, if it did."""
    def is_pinned(self, node: fx.Node) -> bool:
        """Whether this node was made to stay replicated (its region fell back)."""
    def whole_upstream(self, roots: frozenset[str]) -> Fallback | None:
        """The fallback (not one by design) that left whole a projection these roots' inputs are
        computed from, if one did: what keeps them whole is then its consequence."""
    def require_cuts(self, origin: Origin | None, cuts: list[int], scale_size: int, roots: frozenset[str],
                     reason: str) -> None:
        """Ask that the root's layout be cut at these positions of the value's sharded dim."""
    def require_granularity(self, origin: Origin | None, size: int, granularity: int,
                            roots: frozenset[str], reason: str) -> NoReturn:
        """Ask that the root's layout be made of whole blocks of `granularity` of this value's dim
        (raises Demand; Abandon where the layout is not traceable to its root)."""
    def prefers_unit_outer(self, node: fx.Node) -> bool:
        """Whether this reshape should put the shard on a leading size-1 dim (one kv head)."""
    def note_alternative(self, node: fx.Node, roots: frozenset[str]) -> None:
        """This reshape could also read the other way; try that before abandoning `roots`."""
    def node(self, name: str) -> fx.Node:
        """The captured graph's node of this name (a region's root)."""
    def where(self, node: fx.Node | str) -> str:
        """'node view_3 (module transformer.h.0.attn)' for messages (a node, or a node's name)."""
