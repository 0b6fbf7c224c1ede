"""Rules for ops that move or regroup dims without arithmetic: views, transposes, squeezes, expands.
Cutting a dim into pieces (slice, split, chunk) is rules_slices.py."""
from __future__ import annotations

import torch.fx as fx

from autoshard.passes.sharding.index_sets import compress, expand, local_size, tile, untile
from autoshard.passes.sharding.placement import REPLICATE, Abandon, ArgEdit, NodeSharding, Origin, Shard
from autoshard.passes.sharding.rule_context import RuleContext
from autoshard.passes.sharding.shape_algebra import map_reshape_dim

__all__ = ["SHAPE_RULES", "PASSTHROUGH", "sharded_inputs", "norm_dim", "moved", "passthrough"]


def norm_dim(d: int, ndim: int) -> int:
    return d + ndim if d < 0 else d


def sharded_inputs(ctx: RuleContext, node: fx.Node) -> list[Shard]:
    out = []
    for a in node.all_input_nodes:
        p = ctx.place(a)
        if isinstance(p, Shard):
            out.append(p)
    return out


def moved(p: Shard, dim: int, **kw) -> Shard:
    """`p` at another dim (or with other fields): the same shard of a dim that moved."""
    fields = dict(dim=dim, size=p.size, layout=p.layout, roots=p.roots, origin=p.origin)
    fields.update(kw)
    return Shard(**fields)


def passthrough(ctx: RuleContext, node: fx.Node) -> NodeSharding:
    """Same shape as the first argument: unary elementwise ops, dropout, casts, contiguous."""
    return NodeSharding(ctx.place(node.args[0]))


def reshape(ctx: RuleContext, node: fx.Node) -> NodeSharding:
    p = ctx.place(node.args[0])
    if not isinstance(p, Shard):
        return NodeSharding(REPLICATE)
    src, dst = ctx.shape(node.args[0]), ctx.shape(node)
    m = map_reshape_dim(src, dst, p.dim, unit_outer=ctx.prefers_unit_outer(node))
    if m is not None and not ctx.prefers_unit_outer(node):
        other = map_reshape_dim(src, dst, p.dim, unit_outer=True)
        if other is not None and other.out_dim != m.out_dim:
            ctx.note_alternative(node, p.roots)
    if m is None or not dst[m.out_dim].is_Integer:
        raise Abandon(p.roots, f"{ctx.where(node)} reshapes sharded dim {p.dim} of {src} into {dst}")
    flat = tile(expand(p.layout, m.in_inner), m.outer, m.in_size * m.in_inner)
    out_layout = compress(flat, m.out_inner)
    inner_dims = [j for j in range(m.out_dim + 1, len(dst)) if dst[j] != 1]
    if out_layout is None and m.in_inner == 1 and m.outer == 1 and inner_dims and dst[m.out_dim].is_Integer \
            and int(dst[m.out_dim]) > 1:
        # [B*T] tokens in B tiles -> [B, T]: the shard moves to the token dim (sequence parallelism)
        per = untile(p.layout, int(dst[m.out_dim]), m.out_inner)
        j = inner_dims[0]
        if per is not None and dst[j].is_Integer and m.out_inner == int(dst[j]):
            local = local_size(per)
            sizes = node.args[1]
            lit = sizes[j] if len(sizes) == len(dst) else None
            if isinstance(lit, int):
                edits = [ArgEdit(1, (local,) * ctx.tp, item=j)] if lit != -1 else []
                return NodeSharding(Shard(j, int(dst[j]), per, p.roots, None), edits=edits)
    if out_layout is None:
        inner = _inner_shard(ctx, node, p, flat, m, dst)
        if inner is not None:
            return inner
        slots, heads = dst[m.out_dim], dst[m.out_dim + 1] if m.out_dim + 2 < len(dst) else None
        if m.outer == 1 and m.in_inner == 1 and slots.is_Integer and int(slots) % ctx.tp and int(slots) > 1 \
                and heads is not None and heads.is_Integer and int(heads) % ctx.tp == 0 and p.origin is not None:
            # [.., 3 * heads * hd] viewed as [.., 3, heads, hd] (ModernBERT's Wqkv): tp does not divide
            # the 3, so cut the root at q / k / v and split each with its heads (_inner_shard then)
            ctx.require_cuts(p.origin, [k * m.out_inner for k in range(1, int(slots))], p.size, p.roots,
                             f"{ctx.where(node)} views dim {p.dim} ({p.size}) as {int(slots)} blocks of "
                             f"{m.out_inner}, each split with its heads")
        if m.out_inner % m.in_inner:
            raise Abandon(p.roots, f"{ctx.where(node)} splits sharded dim {p.dim} off-block")
        ctx.require_granularity(p.origin, p.size, m.out_inner // m.in_inner, p.roots,
                                f"{ctx.where(node)} views dim {p.dim} ({p.size}) in blocks of "
                                f"{m.out_inner // m.in_inner}")
        raise AssertionError("require_granularity returns only when the layout already fits")
    origin = None
    if p.origin is not None and m.out_inner % m.in_inner == 0 and m.outer == 1:
        origin = Origin(p.origin.root, p.origin.offset, p.origin.scale * (m.out_inner // m.in_inner))
    local = local_size(out_layout)
    if local is None:
        raise Abandon(p.roots, f"{ctx.where(node)}: ranks would hold different sizes")
    padded = p.size != int(src[p.dim])
    if padded and not m.in_inner == m.out_inner == m.outer == 1:
        raise Abandon(p.roots, f"{ctx.where(node)} regroups a padded sharded dim")
    size = p.size if padded else int(dst[m.out_dim])
    out = Shard(m.out_dim, size, out_layout, p.roots, origin)
    sizes = node.args[1]
    edits = []
    lit = sizes[m.out_dim] if len(sizes) == len(dst) else None
    if isinstance(lit, fx.Node) or lit is None:
        raise Abandon(p.roots, f"{ctx.where(node)}: size of sharded dim {m.out_dim} is not a literal")
    if lit != -1:
        edits.append(ArgEdit(1, (local,) * ctx.tp, item=m.out_dim))
    return NodeSharding(out, edits=edits)


def _inner_shard(ctx: RuleContext, node: fx.Node, p: Shard, flat, m, dst) -> NodeSharding | None:
    """The shard on the output dim after `m.out_dim`, when every rank holds the same part of each of
    out_dim's slices: heads {0, 1, 4, 5} of 8 viewed as [2 slots, 4 heads x 8] are features [0, 16)
    of both slots (JetMoE's attention experts, top-k slots of heads)."""
    j = m.out_dim + 1
    if m.outer != 1 or j >= len(dst) or not (dst[m.out_dim].is_Integer and dst[j].is_Integer) \
            or int(dst[m.out_dim]) < 2:
        return None
    per = untile(flat, int(dst[m.out_dim]), m.out_inner)
    inner = m.out_inner // int(dst[j]) if m.out_inner % int(dst[j]) == 0 else None
    lay = compress(per, inner) if per is not None and inner else None
    if lay is None or local_size(lay) is None or p.size != int(ctx.shape(node.args[0])[p.dim]):
        return None
    sizes = node.args[1]
    lit = sizes[j] if len(sizes) == len(dst) else None
    if not isinstance(lit, int):
        return None
    edits = [ArgEdit(1, (local_size(lay),) * ctx.tp, item=j)] if lit != -1 else []
    return NodeSharding(Shard(j, int(dst[j]), lay, p.roots, None), edits=edits)


def expand_rule(ctx: RuleContext, node: fx.Node) -> NodeSharding:
    p = ctx.place(node.args[0])
    if not isinstance(p, Shard):
        return NodeSharding(REPLICATE)
    sizes = node.args[1]
    od = p.dim + len(sizes) - len(ctx.shape(node.args[0]))
    lit = sizes[od]
    edits = []
    if isinstance(lit, fx.Node):
        raise Abandon(p.roots, f"{ctx.where(node)}: expand size of sharded dim is symbolic")
    if lit != -1:
        edits.append(ArgEdit(1, (local_size(p.layout),) * ctx.tp, item=od))
    return NodeSharding(moved(p, od), edits=edits)


def transpose(ctx: RuleContext, node: fx.Node) -> NodeSharding:
    p = ctx.place(node.args[0])
    if not isinstance(p, Shard):
        return NodeSharding(REPLICATE)
    nd = len(ctx.shape(node))
    if node.target.__name__.startswith("t."):
        a, b = 0, 1
    else:
        a, b = norm_dim(node.args[1], nd), norm_dim(node.args[2], nd)
    d = b if p.dim == a else a if p.dim == b else p.dim
    return NodeSharding(moved(p, d))


def permute(ctx: RuleContext, node: fx.Node) -> NodeSharding:
    p = ctx.place(node.args[0])
    if not isinstance(p, Shard):
        return NodeSharding(REPLICATE)
    dims = [norm_dim(d, len(node.args[1])) for d in node.args[1]]
    return NodeSharding(moved(p, dims.index(p.dim)))


def flatten(ctx: RuleContext, node: fx.Node) -> NodeSharding:
    """flatten(x, start, end) merges dims start..end: a sharded dim outside them moves; one inside is
    refused (the shard would be regrouped; a view with literal sizes goes through `reshape`)."""
    p = ctx.place(node.args[0])
    if not isinstance(p, Shard):
        return NodeSharding(REPLICATE)
    nd = len(ctx.shape(node.args[0]))
    start = norm_dim(node.args[1] if len(node.args) > 1 else 0, nd)
    end = norm_dim(node.args[2] if len(node.args) > 2 else -1, nd)
    if start <= p.dim <= end and start != end:
        raise Abandon(p.roots, f"{ctx.where(node)} flattens sharded dim {p.dim} with dims {start}..{end}")
    return NodeSharding(moved(p, p.dim - (end - start) if p.dim > end else p.dim))


def unsqueeze(ctx: RuleContext, node: fx.Node) -> NodeSharding:
    p = ctx.place(node.args[0])
    if not isinstance(p, Shard):
        return NodeSharding(REPLICATE)
    k = norm_dim(node.args[1], len(ctx.shape(node)))
    return NodeSharding(moved(p, p.dim + (1 if k <= p.dim else 0)))


def squeeze(ctx: RuleContext, node: fx.Node) -> NodeSharding:
    p = ctx.place(node.args[0])
    if not isinstance(p, Shard):
        return NodeSharding(REPLICATE)
    src = ctx.shape(node.args[0])
    dims = node.args[1] if len(node.args) > 1 else list(range(len(src)))
    dims = [dims] if isinstance(dims, int) else dims
    gone = {norm_dim(d, len(src)) for d in dims if src[norm_dim(d, len(src))] == 1}
    return NodeSharding(moved(p, p.dim - sum(1 for g in gone if g < p.dim)))


def select(ctx: RuleContext, node: fx.Node) -> NodeSharding:
    p = ctx.place(node.args[0])
    if not isinstance(p, Shard):
        return NodeSharding(REPLICATE)
    d = norm_dim(node.args[1], len(ctx.shape(node.args[0])))
    if d == p.dim:
        raise Abandon(p.roots, f"{ctx.where(node)} selects one index of a sharded dim")
    return NodeSharding(moved(p, p.dim - (1 if d < p.dim else 0)))


def getitem(ctx: RuleContext, node: fx.Node) -> NodeSharding:
    src = node.args[0]
    p = ctx.place(src)
    if isinstance(p, tuple):
        return NodeSharding(p[node.args[1]])
    if isinstance(p, Shard):
        raise Abandon(p.roots, f"{ctx.where(node)} indexes into a sharded value")
    return NodeSharding(REPLICATE)


# ops whose output has their input's placement (unary, casts, copies): padding-safe too (op_table)
PASSTHROUGH = (
    "contiguous", "clone", "alias", "detach", "to", "_to_copy", "type_as", "dropout",
    "gelu", "silu", "relu", "tanh", "sigmoid", "neg", "exp", "log", "sqrt",
    "rsqrt", "erf", "abs", "square", "reciprocal", "sin", "cos", "log1p", "expm1",
    "softplus", "leaky_relu", "elu", "hardtanh", "_assert_tensor_metadata", "lift_fresh_copy",
    "zeros_like", "ones_like", "empty_like", "full_like", "fill", "clamp", "nan_to_num",
    "logical_not", "bitwise_not", "sign", "floor", "ceil", "round", "trunc", "scalar_tensor_like",
)

SHAPE_RULES = {
    "view": reshape, "reshape": reshape, "_unsafe_view": reshape,
    "expand": expand_rule, "transpose": transpose, "t": transpose, "permute": permute,
    "unsqueeze": unsqueeze, "flatten": flatten, "squeeze": squeeze, "select": select, "getitem": getitem,
    **{name: passthrough for name in PASSTHROUGH},
}
