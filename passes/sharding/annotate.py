"""Sharding analysis: writes `node.meta["sharding"]` on every node and returns the plan. No rewrite.

Nodes are visited in order and each op's rule (the table in `op_table`) gives its placement. Two
signals move the visit back instead of forward, always to the start of the region concerned, so the
work stays linear in the number of layers:
- Abandon: a region meets an op the table cannot shard; its column-parallel roots are pinned
  replicated (a correct fallback, reported) and the region is visited again.
- Demand: a consumer needs the root's layout cut differently (a fused QKV split, a head view); the
  root's recipe is refined and the region is visited again.
Before a region is abandoned, a reshape in it that reads two ways ([B, T, 8] -> [B, T, 1, 8]: an
unsqueeze, or one kv head of 8) is read the other way once and the region visited again; this is
what lets multi-query attention shard.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from math import lcm
from typing import NoReturn

import sympy
import torch.fx as fx

from autoshard.errors import ShardingError
from autoshard.passes.graph_reading import module_path, op_name, param_read
from autoshard.passes.sharding.index_sets import (
    Layout,
    LayoutError,
    Segment,
    cut_segments,
    layout_from_segments,
    padded_even_layout,
)
from autoshard.passes.sharding.op_table import PADDING_SAFE, rule_for
from autoshard.passes.sharding.options import ShardOptions
from autoshard.passes.sharding.placement import (
    REPLICATE,
    Abandon,
    Demand,
    NodeSharding,
    ParamUse,
    Placement,
    ReadSplit,
    Shard,
)
from autoshard.passes.sharding.report import Fallback, trim_fallbacks, unexplained_replicated, with_first_cause
from autoshard.passes.sharding.shape_algebra import to_sympy

_LOOKBACK = 200     # nodes visited when asking what a projection's input is computed from

__all__ = ["ShardingPlan", "ShardOptions", "Fallback", "annotate", "module_path", "param_read"]


@dataclass
class ShardingPlan:
    tp: int
    params: dict[str, ParamUse]                  # every parameter read sharded: its dim and layout
    fallbacks: list[Fallback] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)   # matmuls with indivisible output features


class _Analysis:
    def __init__(self, gm: fx.GraphModule, tp: int, param_names: dict[str, str], options: ShardOptions):
        self.gm, self.tp, self.param_names, self.options = gm, tp, param_names, options
        self.nodes = list(gm.graph.nodes)
        self.index = {n: i for i, n in enumerate(self.nodes)}
        self.by_name = {n.name: n for n in self.nodes}
        self.pinned: set[str] = set()
        self.recipes: dict[str, list[Segment]] = {}
        self.recipe_why: dict[str, str] = {}
        self.uses: dict[str, dict[int, ParamUse]] = {}
        self.fallbacks: list[Fallback] = []
        self.skipped: dict[str, str] = {}
        self.unit_outer: set[str] = set()                   # reshapes read as one-head views
        self.unpadded: set[str] = set()                     # roots whose padding met an unsafe op
        self.tokens: dict[str, tuple[tuple, int, Shard]] = {}   # column root -> (x shape, dim, placement)
        self.alternatives: dict[str, frozenset[str]] = {}   # reshape -> roots it could help
        self.read_splits: dict[str, ReadSplit] = {}         # gathers of parameter rows read split
        self.current = 0

    # ---- RuleContext -------------------------------------------------------------------------
    def place(self, arg: object) -> Placement:
        if isinstance(arg, fx.Node):
            return arg.meta.get("sharding", NodeSharding()).placement
        return REPLICATE

    def shape(self, node: fx.Node) -> list[sympy.Expr]:
        return [to_sympy(s) for s in node.meta["val"].shape]

    def param(self, arg: object) -> tuple[str, bool] | None:
        return param_read(arg, self.param_names)

    def node(self, name: str) -> fx.Node:
        return self.by_name[name]

    def where(self, node: fx.Node | str) -> str:
        node = self.by_name[node] if isinstance(node, str) else node
        return f"node {node.name} (module {module_path(node)})"

    def prefers_unit_outer(self, node: fx.Node) -> bool:
        return node.name in self.unit_outer

    def note_alternative(self, node: fx.Node, roots: frozenset[str]) -> None:
        self.alternatives.setdefault(node.name, roots)

    def note_tokens(self, node: fx.Node, x: fx.Node, p: Shard) -> None:
        self.tokens[node.name] = (tuple(self.shape(x)[:-1]), p.dim, p)

    def tokens_for(self, node: fx.Node, roots: frozenset[str]) -> tuple[int, Shard] | None:
        """Sequence shards to reduce-scatter a row-parallel output onto: those its region's column
        inputs were gathered from, when the output has the same token dims as those inputs."""
        out_tokens = tuple(self.shape(node)[:-1])
        for r in sorted(roots):
            if r in self.tokens and self.tokens[r][0] == out_tokens:
                return self.tokens[r][1], self.tokens[r][2]
        return None

    def split_read(self, node: fx.Node) -> ReadSplit | None:
        return self.read_splits.get(node.name)

    def is_pinned(self, node: fx.Node) -> bool:
        return node.name in self.pinned

    def whole_upstream(self, roots: frozenset[str]) -> Fallback | None:
        # Walk back from each root's input to the weights it is computed from (not past them): a
        # projection whose input is whole because an earlier region fell back is that fallback's
        # consequence, not a design choice.
        failed = {r: f for f in self.fallbacks if not f.by_design for r in f.roots}
        seen: set[fx.Node] = set()
        frontier = [a for r in roots for a in self.by_name[r].all_input_nodes[:1]]
        while frontier and len(seen) < _LOOKBACK:
            n = frontier.pop()
            if n in seen:
                continue
            seen.add(n)
            if n.name in failed:
                return failed[n.name]
            if not any(self.param(a) is not None for a in n.args[1:3]):
                frontier.extend(n.all_input_nodes)
        return None

    def root_layout(self, node: fx.Node, size: int, weight: tuple[str, int] | None = None
                    ) -> tuple[Layout, int | None] | None:
        if node.name in self.pinned:
            return None
        if weight is not None and node.name not in self.recipes:
            for j, u in self.uses.get(weight[0], {}).items():
                if j < self.current and u.dim == weight[1] and u.layout is not None:
                    return u.layout, u.padded
        if size < self.tp and node.name not in self.recipes:
            # fewer features than ranks (a gate's one score per token): each rank would hold them all
            self.skipped[node.name] = f"{self.where(node)}: {size} output feature(s), fewer than tp={self.tp}"
            return None
        recipe = self.recipes.get(node.name, [Segment(0, size)])
        try:
            return layout_from_segments(recipe, self.tp), None
        except LayoutError as e:
            if node.name not in self.recipes:
                if self.options.vocab_parallel and node.name not in self.unpadded:
                    # Pad to a multiple of tp (a vocabulary); PADDING_SAFE keeps the padding harmless.
                    return padded_even_layout(size, self.tp)
                self.skipped[node.name] = (f"{self.where(node)}: output features {size} not divisible "
                                           f"by tp={self.tp}; left replicated")
                return None
            raise ShardingError(f"tp={self.tp} cannot shard {self.where(node)}: {e}; "
                                f"required by {self.recipe_why[node.name]}") from None

    def require_cuts(self, origin, cuts, size, roots, reason) -> None:
        if origin is None:
            raise Abandon(roots, reason + " (layout not traceable to its root)")
        root_cuts = [origin.offset + c * origin.scale for c in cuts]
        segs = self._recipe(origin.root)
        new = cut_segments(segs, root_cuts)
        if new != segs:
            raise Demand(origin.root, reason, cuts=tuple(root_cuts))

    def require_granularity(self, origin, size, granularity, roots, reason) -> NoReturn:
        if origin is None:
            raise Abandon(roots, reason + " (layout not traceable to its root)")
        lo, hi = origin.offset, origin.offset + size * origin.scale
        raise Demand(origin.root, reason, granularity=(lo, hi, granularity * origin.scale))

    # ---- driver ------------------------------------------------------------------------------
    def _recipe(self, root: str) -> list[Segment]:
        size = int(self.by_name[root].meta["val"].shape[-1])
        return self.recipes.get(root, [Segment(0, size)])

    def run(self) -> None:
        i = 0
        while i < len(self.nodes):
            node = self.nodes[i]
            self.current = i
            try:
                self._check_padding(node)
                result = rule_for(node)(self, node) if node.op in ("call_function", "call_module", "output") \
                    else NodeSharding(REPLICATE)
                result.region = _region(self, node, result)
                self._record_params(node, result)
            except Abandon as a:
                i = self._abandon(a.roots, a.reason, by_design=a.by_design)
                continue
            except Demand as d:
                i = self._demand(d)
                continue
            except ReadSplit as r:
                self.read_splits[r.node] = r
                i = self.index[self.by_name[r.node]]
                continue
            except ShardingError as e:
                raise with_first_cause(e, self.fallbacks, node) from None
            node.meta["sharding"] = result
            i += 1

    def _check_padding(self, node: fx.Node) -> None:
        """Padded columns (past the real size) may only meet ops that ignore or zero them."""
        if node.op != "call_function" or op_name(node.target) in PADDING_SAFE:
            return
        for a in node.all_input_nodes:
            p = self.place(a)
            if isinstance(p, Shard) and p.size != int(self.shape(a)[p.dim]):
                root = min(p.roots, key=lambda r: self.index[self.by_name[r]])
                raise Demand(root, f"{self.where(node)} meets a padded sharded dim ({p.size} for "
                                   f"{int(self.shape(a)[p.dim])})", unpad=True)

    def _abandon(self, roots: frozenset[str], reason: str, *, by_design: bool = False) -> int:
        # Before giving a region up, read one of its ambiguous reshapes the other way (each once).
        for name, alt_roots in self.alternatives.items():
            if name not in self.unit_outer and alt_roots & roots:
                self.unit_outer.add(name)
                for r in roots | alt_roots:     # layouts demanded under the other reading
                    self.recipes.pop(r, None)
                return min(self.index[self.by_name[r]] for r in roots | alt_roots)
        if roots and roots <= self.pinned and not any(r.roots & roots for r in self.read_splits.values()):
            # every root is left whole already and its value is still sharded here (a sequence
            # shard, which pinning does not undo): running again would meet the same node forever
            names = ", ".join(sorted(roots)[:3]) + (", ..." if len(roots) > 3 else "")
            raise ShardingError(f"tp={self.tp}: {reason}, and leaving its region ({names}) whole does not "
                                f"change that" + (" (sequence parallelism shards its tokens); compile without "
                                                  "sequence_parallel" if self.options.sequence_parallel else ""))
        self.pinned |= roots
        self.read_splits = {k: r for k, r in self.read_splits.items() if not r.roots & roots}
        names = tuple(sorted(roots))
        self.fallbacks.append(Fallback(names, tuple(module_path(self.by_name[r]) for r in names), reason, by_design))
        return min(self.index[self.by_name[r]] for r in roots)

    def _demand(self, d: Demand) -> int:
        if d.unpad:      # the root's output stays whole (replicated) rather than padded
            if d.root in self.unpadded:
                return self._abandon(frozenset([d.root]), d.reason)
            self.unpadded.add(d.root)
            return self.index[self.by_name[d.root]]
        old = self._recipe(d.root)
        new = cut_segments(old, list(d.cuts))
        if d.granularity:
            # Pieces of a fused weight that have the demanded piece's size (q, k, v of a fused QKV)
            # share its head size: refine them together, so the split still sees equal pieces.
            lo, hi, g = d.granularity
            new = cut_segments(new, [lo, hi])
            sizes = {s.size for s in new if lo <= s.start < hi}
            new = [Segment(s.start, s.size, lcm(s.granularity, g)) if lo <= s.start < hi or s.size in sizes else s
                   for s in new]
        if new == old:
            return self._abandon(frozenset([d.root]), d.reason + " (no layout of the root satisfies it)")
        self.recipes[d.root] = new
        self.recipe_why[d.root] = d.reason
        stale = [k for k, r in self.read_splits.items() if d.root in r.roots]     # cut to the old layout
        for k in stale:
            del self.read_splits[k]
        return min(self.index[self.by_name[n]] for n in [d.root, *stale])

    def _record_params(self, node: fx.Node, result: NodeSharding) -> None:
        named = {u.name for u in result.params}
        for a in node.all_input_nodes:
            prm = self.param(a)
            if prm and prm[0] not in named and not self._is_param_view(node):
                result.params.append(ParamUse(prm[0]))
                named.add(prm[0])
        i = self.index[node]
        roots = result.region
        for use in result.params:
            earlier = {j: u for j, u in self.uses.get(use.name, {}).items() if j < i}
            for j, u in earlier.items():
                if u == use:
                    continue
                if use.layout is None:      # read whole here, sharded earlier: undo the earlier region
                    raise Abandon(self.nodes[j].meta["sharding"].region,
                                  f"parameter {use.name} is also read whole at {self.where(node)}")
                raise Abandon(roots or frozenset([node.name]),
                              f"parameter {use.name} is also read "
                              f"{'whole' if u.layout is None else 'split differently'} at {self.where(self.nodes[j])}")
            self.uses.setdefault(use.name, {})[i] = use

    def _is_param_view(self, node: fx.Node) -> bool:
        """A view of a parameter that its readers read as the parameter (graph_reading.param_read):
        a transpose, or the squeeze of a squeeze-unsqueeze pair (each of its users reads it back
        as the parameter)."""
        if self.param(node) is not None:
            return True
        return bool(node.users) and all(self.param(u) is not None and u.args[0] is node for u in node.users)


def _region(ctx: _Analysis, node: fx.Node, result: NodeSharding) -> frozenset[str]:
    """The column-parallel roots whose region this node is part of (inputs or outputs sharded)."""
    outs = result.placement if isinstance(result.placement, tuple) else (result.placement,)
    places = [ctx.place(a) for a in node.all_input_nodes] + list(outs)
    flat = [q for p in places for q in (p if isinstance(p, tuple) else (p,))]
    own = frozenset([node.name]) if result.role == "vocab" else frozenset()
    return own.union(*(p.roots for p in flat if isinstance(p, Shard)))


def annotate(gm: fx.GraphModule, tp: int, param_names: dict[str, str],
             options: ShardOptions | None = None) -> ShardingPlan:
    """Annotate every node of `gm` with its tensor-parallel placement for `tp` ranks.

    `param_names` maps get_attr targets to the model's canonical parameter names (tied weights map
    to one name). Returns the plan: which parameters are read sharded, and what fell back.
    """
    if tp == 1:
        for n in gm.graph.nodes:
            n.meta["sharding"] = NodeSharding(REPLICATE)
        return ShardingPlan(tp, {})
    a = _Analysis(gm, tp, param_names, options or ShardOptions())
    a.run()
    params: dict[str, ParamUse] = {}
    for name, uses in a.uses.items():
        final = [u for j, u in uses.items() if a.nodes[j].meta.get("sharding") is not None]
        sharded = {u for u in final if u.layout is not None}
        if sharded and len(sharded) == len(set(final)) == 1:
            params[name] = sharded.pop()
    fallbacks = trim_fallbacks(list({f.roots: f for f in a.fallbacks}.values()), a.by_name, params, param_names)
    return ShardingPlan(tp, params, fallbacks,
                        sorted(a.skipped.values()) + unexplained_replicated(gm, params, fallbacks, param_names))
