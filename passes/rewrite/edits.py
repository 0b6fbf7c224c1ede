"""What each edit of the sharding analysis does to a node of rank r's graph: a table.

The analysis (passes/sharding/) writes a list of edits into `node.meta["sharding"].edits`; the
rewrite (rank_rewrite.py) applies them through `EDITS`, one row per edit kind:

    EDITS[type(edit)] = Edit(phase, apply, after)

`apply(rw, call, edit)` changes the node's call before it is emitted (its arguments, the row
reduction it needs) or, for an edit that replaces the node, emits the replacement; `after(rw, call,
edit, new)` wraps the emitted node (a reduction, a mask). Phases run in order: ARGS (arguments),
then REPLACE (lookups and the loss, which read the edited arguments). READ rows are edits other
code reads (the output gathers, the scatter a lookup ends in). A new edit kind is a new row here;
one without a row is refused, naming the node.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.fx as fx

from autoshard.bounds import check_token_ids
from autoshard.parallel.vocab_parallel import CrossEntropySpec
from autoshard.passes.sharding.placement import (
    ArgEdit,
    ColumnInput,
    GatherOutputs,
    GatherTokens,
    NodeSharding,
    PartialStatistic,
    Restrict,
    RowParallel,
    SequenceScatter,
    VocabCrossEntropy,
    VocabLookup,
)
from autoshard.passes.rewrite.rank_state import RankRewrite

__all__ = ["ARGS", "EDITS", "Edit", "NodeCall", "READ", "REPLACE"]

aten = torch.ops.aten

ARGS, REPLACE, READ = "args", "replace", "read"


@dataclass
class NodeCall:
    """One node of the captured graph on its way into rank r's graph."""

    node: fx.Node
    ns: NodeSharding
    args: list
    kwargs: dict
    row: RowParallel | None = None            # partial sums to reduce after the node
    bias: fx.Node | None = None               # a row-parallel node's bias, added after the reduction
    outside: fx.Node | None = None            # a vocabulary lookup's ids that other ranks own
    replaced: fx.Node | None = None           # an edit emitted the node's whole replacement


@dataclass(frozen=True)
class Edit:
    phase: str
    apply: Callable[[RankRewrite, NodeCall, object], None] | None = None
    after: Callable[[RankRewrite, NodeCall, object, fx.Node], fx.Node] | None = None


def _set(container, edit_item, value):
    if edit_item is None:
        return value
    seq = list(container)
    seq[edit_item] = value
    return seq


def _arg_edit(rw: RankRewrite, call: NodeCall, e: ArgEdit) -> None:
    """A literal argument (a size, a split) that differs per rank."""
    where = call.kwargs if isinstance(e.arg, str) else call.args
    where[e.arg] = _set(where[e.arg], e.item, e.values[rw.r])


def _restrict(rw: RankRewrite, call: NodeCall, e: Restrict) -> None:
    """Keep this rank's rows of a replicated argument: one slice, or an index_select of them."""
    src = call.args[e.arg] if e.item is None else call.args[e.arg][e.item]
    keep = e.keep[rw.r]
    if all(len(k) == 1 for k in e.keep):
        (a, b), = keep
        kept = rw.g.call_function(aten.slice.Tensor, (src, e.dim, a, b))
        kept.meta["rank_part"] = True       # this rank's part of a dim (read by passes/context/rules.py)
    else:
        name = f"_keep_{call.node.name}_{e.arg}{rw.suffix}"
        rw.buffers[name] = torch.tensor([i for a, b in keep for i in range(a, b)])
        kept = rw.g.call_function(aten.index_select.default, (src, e.dim, rw.g.get_attr(name)))
    call.args[e.arg] = _set(call.args[e.arg], e.item, kept)


def _gather_tokens(rw: RankRewrite, call: NodeCall, e: GatherTokens) -> None:
    """Sequence parallelism: the full sequence gathered from the ranks' shards (once per value)."""
    x = call.node.args[e.arg]
    if x not in rw.tokens_of:
        kind = "all_gather" if e.reduce_grads else "all_gather_keep_grad"
        rw.tokens_of[x] = rw.seq_collective(kind, f"gather_from_sequence_{x.name}", e.dim, e.outer, rw.env[x])
    call.args[e.arg] = rw.tokens_of[x]


def _column_input(rw: RankRewrite, call: NodeCall, e: ColumnInput) -> None:
    """A column-parallel input: through f. Gathered tokens need none (the all-gather's backward
    reduce-scatter sums the gradients); one f per source value, shared with read_entering: never f(f(x))."""
    x = call.node.args[e.arg]
    if x in rw.tokens_of:
        return
    if x not in rw.f_of:
        rw.f_of[x] = rw.g.call_module("f", (call.args[e.arg],))
    call.args[e.arg] = rw.f_of[x]


def _row_parallel(rw: RankRewrite, call: NodeCall, e: RowParallel) -> None:
    call.row = e       # the bias is held back at emission and added after the reduction (`_reduce_row`)


def _reduce_row(rw: RankRewrite, call: NodeCall, e: RowParallel, new: fx.Node) -> fx.Node:
    """Partial sums: reduced (g), or reduce-scattered onto sequence shards; then the bias, once."""
    node = call.node
    new = rw.seq_collective("reduce_scatter", f"reduce_scatter_to_sequence_{node.name}", *e.scatter, new) \
        if e.scatter is not None else rw.g.call_module("g", (new,))
    new.meta["shape_of"] = node.name         # the captured linear's (its single-device shape)
    if call.bias is not None:
        new = rw.g.call_function(aten.add.Tensor, (new, call.bias))
        new.meta["shape_of"] = node.name
    return new


def _sum_statistic(rw: RankRewrite, call: NodeCall, e: PartialStatistic, new: fx.Node) -> fx.Node:
    """A norm's statistic of this rank's features, summed over the ranks (g), then scaled: the
    mean of all features is the mean of the ranks' equal-sized means."""
    new = rw.g.call_module("g", (new,))
    new.meta["shape_of"] = call.node.name
    if e.scale != 1.0:
        new = rw.g.call_function(aten.mul.Tensor, (new, e.scale))
        new.meta["shape_of"] = call.node.name
    return new


def _vocab_lookup(rw: RankRewrite, call: NodeCall, e: VocabLookup) -> None:
    """Ids this rank owns, shifted to local rows; the others point at row 0 and are zeroed after."""
    g, args = rw.g, call.args
    start, valid = e.starts[rw.r], e.valid[rw.r]
    checked = g.call_function(check_token_ids, (args[1], sum(e.valid)))     # as nn.Embedding raises
    local = g.call_function(aten.sub.Tensor, (checked, start))
    outside = g.call_function(aten.__or__.Tensor, (g.call_function(aten.lt.Scalar, (local, 0)),
                                                  g.call_function(aten.ge.Scalar, (local, valid))))
    args[1] = g.call_function(aten.masked_fill.Scalar, (local, outside, 0))
    if len(args) > 2 and args[2] is not None and args[2] >= 0:      # padding_idx
        args[2] = args[2] - start if start <= args[2] < start + valid else -1
    call.outside = outside


def _mask_lookup(rw: RankRewrite, call: NodeCall, e: VocabLookup, new: fx.Node) -> fx.Node:
    """Rows of ids other ranks own are zeroed, then summed over the ranks (or reduce-scattered)."""
    node, g = call.node, rw.g
    mask = g.call_function(aten.unsqueeze.default, (call.outside, -1))
    new = g.call_function(aten.masked_fill.Scalar, (new, mask, 0.0))
    scatter = next((s for s in call.ns.edits if isinstance(s, SequenceScatter)), None)
    return rw.seq_collective("reduce_scatter", f"reduce_scatter_to_sequence_{node.name}", scatter.dim,
                             scatter.outer, new) if scatter else g.call_module("g", (new,))


def _vocab_cross_entropy(rw: RankRewrite, call: NodeCall, e: VocabCrossEntropy) -> None:
    """The loss over vocabulary shards: one CrossEntropySpec module replaces the node."""
    args, kwargs, r = call.args, call.kwargs, rw.r
    red = args[3] if len(args) > 3 else kwargs.get("reduction", 1)
    ignore = args[4] if len(args) > 4 else kwargs.get("ignore_index", -100)
    spec = CrossEntropySpec(f"vocab_cross_entropy_{call.node.name}{rw.suffix}", e.starts[r], e.counts[r], e.valid[r],
                            ignore, red, sum(e.valid))
    rw.modules.append(spec)
    call.replaced = rw.g.call_module(spec.module, (args[0], args[1]))


EDITS: dict[type, Edit] = {
    ArgEdit: Edit(ARGS, _arg_edit),
    Restrict: Edit(ARGS, _restrict),
    GatherTokens: Edit(ARGS, _gather_tokens),
    ColumnInput: Edit(ARGS, _column_input),
    RowParallel: Edit(ARGS, _row_parallel, _reduce_row),
    PartialStatistic: Edit(ARGS, None, _sum_statistic),
    VocabLookup: Edit(REPLACE, _vocab_lookup, _mask_lookup),
    VocabCrossEntropy: Edit(REPLACE, _vocab_cross_entropy),
    SequenceScatter: Edit(READ),          # read by _mask_lookup
    GatherOutputs: Edit(READ),            # read where the output is emitted (rank_rewrite.gather_out)
}
