"""Rules for ops that cut a dim into pieces: slice (with a step too), split, split_with_sizes, chunk.

A cut of the sharded dim asks the root for a layout cut at the same positions (a fused QKV split
into q, k and v), so that each piece is spread evenly over the ranks; the per-rank bounds and sizes
are then literals that differ by rank (ArgEdit).
"""
from __future__ import annotations

import torch.fx as fx

from autoshard.passes.graph_reading import op_name
from autoshard.passes.sharding.index_sets import compress, local_size, window
from autoshard.passes.sharding.placement import REPLICATE, Abandon, ArgEdit, NodeSharding, Origin, Shard
from autoshard.passes.sharding.rule_context import RuleContext
from autoshard.passes.sharding.rules_shape import moved, norm_dim

__all__ = ["SLICE_RULES"]


def _pieces(ctx: RuleContext, node: fx.Node, p: Shard, bounds: list[tuple[int, int]]) -> list[Shard]:
    """Cut the sharded dim at `bounds`: each piece must be spread evenly over the ranks."""
    cuts = sorted({a for a, _ in bounds} | {b for _, b in bounds})
    if p.origin is not None:     # otherwise (a cat of shards) the layout is what it is: even pieces, or refused below
        ctx.require_cuts(p.origin, cuts, p.size, p.roots, f"{ctx.where(node)} cuts sharded dim {p.dim} at {cuts}")
    out = []
    for a, b in bounds:
        lay = window(p.layout, a, b)
        if local_size(lay) is None:
            raise Abandon(p.roots, f"{ctx.where(node)}: piece [{a}, {b}) is not spread evenly")
        org = p.origin and Origin(p.origin.root, p.origin.offset + a * p.origin.scale, p.origin.scale)
        out.append(Shard(p.dim, b - a, lay, p.roots, org))
    return out


def _held_before(p: Shard, r: int, pos: int) -> int:
    return sum(max(0, min(b, pos) - a) for a, b in p.layout[r])


def slice_rule(ctx: RuleContext, node: fx.Node) -> NodeSharding:
    p = ctx.place(node.args[0])
    if not isinstance(p, Shard):
        return NodeSharding(REPLICATE)
    nd = len(ctx.shape(node.args[0]))
    d = norm_dim(node.args[1] if len(node.args) > 1 else 0, nd)
    if d != p.dim:
        return NodeSharding(p)
    start = node.args[2] if len(node.args) > 2 and node.args[2] is not None else 0
    end = node.args[3] if len(node.args) > 3 and node.args[3] is not None else p.size
    step = node.args[4] if len(node.args) > 4 else 1
    if not all(isinstance(v, int) for v in (start, end, step)):
        raise Abandon(p.roots, f"{ctx.where(node)} slices a sharded dim with symbolic bounds")
    start, end = (norm_dim(start, p.size), min(norm_dim(end, p.size), p.size))
    if step != 1:
        return _strided(ctx, node, p, start, end, step)
    if (start, end) == (0, p.size):
        return NodeSharding(p)
    (piece,) = _pieces(ctx, node, p, [(start, end)])
    edits = [ArgEdit(2, tuple(_held_before(p, r, start) for r in range(ctx.tp))),
             ArgEdit(3, tuple(_held_before(p, r, end) for r in range(ctx.tp)))]
    return NodeSharding(piece, edits=edits)


def _strided(ctx: RuleContext, node: fx.Node, p: Shard, start: int, end: int, step: int) -> NodeSharding:
    """x[..., start::step] with start < step, to the end (gpt-oss's interleaved gate and up columns):
    when every rank holds whole blocks of `step`, its local slice picks one index per block, so
    block i of the dim is index i of the result. Otherwise the root is asked for such blocks."""
    if start >= step or end != p.size or p.size % step or p.size != int(ctx.shape(node.args[0])[p.dim]):
        raise Abandon(p.roots, f"{ctx.where(node)} slices sharded dim {p.dim} [{start}:{end}:{step}]")
    blocks = compress(p.layout, step)
    if blocks is None:
        ctx.require_granularity(p.origin, p.size, step, p.roots,
                                f"{ctx.where(node)} takes every {step}th index of dim {p.dim} ({p.size})")
    local = local_size(blocks)
    edits = [ArgEdit(3, (local * step,) * ctx.tp)] if len(node.args) > 3 and node.args[3] == p.size else []
    return NodeSharding(Shard(p.dim, p.size // step, blocks, p.roots, None), edits=edits)


def split(ctx: RuleContext, node: fx.Node) -> NodeSharding:
    p = ctx.place(node.args[0])
    n_out = len(node.meta["val"])
    if not isinstance(p, Shard):
        return NodeSharding((REPLICATE,) * n_out)
    nd = len(ctx.shape(node.args[0]))
    d = norm_dim(node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0), nd)
    if d != p.dim:
        return NodeSharding((p,) * n_out)
    sizes = [int(t.shape[d]) for t in node.meta["val"]]
    bounds = [(sum(sizes[:i]), sum(sizes[:i + 1])) for i in range(len(sizes))]
    pieces = _pieces(ctx, node, p, bounds)
    local = [local_size(q.layout) for q in pieces]
    if op_name(node.target) == "chunk":        # chunk(x, n): n pieces locally too, if they come out the same
        if len(set(local)) != 1:
            raise Abandon(p.roots, f"{ctx.where(node)}: uneven chunks of a sharded dim")
        return NodeSharding(tuple(pieces))
    if isinstance(node.args[1], int):
        if len(set(local)) != 1:
            raise Abandon(p.roots, f"{ctx.where(node)}: uneven split of a sharded dim")
        edits = [ArgEdit(1, (local[0],) * ctx.tp)]
    else:
        edits = [ArgEdit(1, (v,) * ctx.tp, item=i) for i, v in enumerate(local)]
    return NodeSharding(tuple(pieces), edits=edits)


def unbind(ctx: RuleContext, node: fx.Node) -> NodeSharding:
    """unbind(x, dim): one value per index of `dim` (ModernBERT's q, k, v off [.., 3, heads, hd]);
    a shard on another dim is in every one, one place left when it comes after `dim`."""
    p = ctx.place(node.args[0])
    n_out = len(node.meta["val"])
    if not isinstance(p, Shard):
        return NodeSharding((REPLICATE,) * n_out)
    d = norm_dim(node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0), len(ctx.shape(node.args[0])))
    if d == p.dim:
        raise Abandon(p.roots, f"{ctx.where(node)} unbinds its sharded dim {d}")
    return NodeSharding((moved(p, p.dim - 1 if p.dim > d else p.dim),) * n_out)


SLICE_RULES = {"slice": slice_rule, "split": split, "split_with_sizes": split, "chunk": split, "unbind": unbind}
