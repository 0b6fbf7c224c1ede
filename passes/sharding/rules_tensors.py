"""Rules for ops that make a tensor from a sharded one's layout: tensors shaped like it (new_empty,
new_zeros, new_full, new_ones), copies tiled along a dim (repeat, repeat_interleave), complex views
of feature pairs (view_as_complex, view_as_real: Llama 4's and DeepSeek-V2's rotary), and rows
picked or added by index along a dim that is not sharded (index, index_add: tokens routed to experts),
and padding of a dim that is not sharded.
"""
from __future__ import annotations

import torch.fx as fx

from autoshard.passes.graph_reading import op_name
from autoshard.passes.sharding.index_sets import expand, local_size, tile
from autoshard.passes.sharding.placement import REPLICATE, Abandon, ArgEdit, NodeSharding, ParamUse, Restrict, Shard
from autoshard.passes.sharding.rule_context import RuleContext
from autoshard.passes.sharding.rules_shape import moved, norm_dim

__all__ = ["TENSOR_RULES", "gathered_param_dim"]


def new_like(ctx: RuleContext, node: fx.Node) -> NodeSharding:
    """x.new_empty(size) and kin: sharded like x when `size` keeps x's sharded dim whole (DeepSeek's
    keys, built in `kv.new_empty(*kv.shape[:-1], d)` and filled by copy_); otherwise a tensor of its own."""
    p = ctx.place(node.args[0])
    sizes = node.args[1]
    if not isinstance(p, Shard) or len(sizes) != len(ctx.shape(node.args[0])):
        return NodeSharding(REPLICATE)
    lit = sizes[p.dim]
    if not isinstance(lit, int) or lit != p.size or p.size != int(ctx.shape(node.args[0])[p.dim]):
        return NodeSharding(REPLICATE)
    # index i of the new tensor's sharded dim is index i of x's: the same layout, traced to the same root
    return NodeSharding(moved(p, p.dim), edits=[ArgEdit(1, (local_size(p.layout),) * ctx.tp, item=p.dim)])


def repeat(ctx: RuleContext, node: fx.Node) -> NodeSharding:
    """x.repeat(*reps): the sharded dim repeated k times holds the rank's indices in each of the k
    copies ([x, x] of a rank's shard is its part of every copy, in order)."""
    p = ctx.place(node.args[0])
    if not isinstance(p, Shard):
        return NodeSharding(REPLICATE)
    reps = node.args[1]
    od = p.dim + len(reps) - len(ctx.shape(node.args[0]))
    k = reps[od]
    if not isinstance(k, int):
        raise Abandon(p.roots, f"{ctx.where(node)} repeats sharded dim {p.dim} a symbolic number of times")
    if k == 1:
        return NodeSharding(moved(p, od))
    return NodeSharding(Shard(od, p.size * k, tile(p.layout, k, p.size), p.roots, None))


def repeat_interleave(ctx: RuleContext, node: fx.Node) -> NodeSharding:
    """repeat_interleave(x, k, dim): index i of the sharded dim becomes k neighbours [i*k, (i+1)*k)."""
    p = ctx.place(node.args[0])
    if not isinstance(p, Shard):
        return NodeSharding(REPLICATE)
    k = node.args[1] if len(node.args) > 1 else node.kwargs.get("repeats")
    dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim")
    if not isinstance(k, int) or dim is None:
        raise Abandon(p.roots, f"{ctx.where(node)} repeats a sharded value by a tensor or over all dims")
    if norm_dim(dim, len(ctx.shape(node.args[0]))) != p.dim:
        return NodeSharding(p)
    res = NodeSharding(Shard(p.dim, p.size * k, expand(p.layout, k), p.roots, None))
    if node.kwargs.get("output_size") is not None:      # the whole dim's size: each rank's own (Bamba's B, C)
        local = local_size(p.layout)
        if local is None:
            raise Abandon(p.roots, f"{ctx.where(node)} gives repeat_interleave an output_size that ranks "
                                   f"holding different counts cannot share")
        res.edits.append(ArgEdit("output_size", (local * k,) * ctx.tp))
    return res


def view_as_complex(ctx: RuleContext, node: fx.Node) -> NodeSharding:
    """[..., n, 2] real -> [..., n] complex: a shard outside the last (pair) dim stays where it is."""
    p = ctx.place(node.args[0])
    if not isinstance(p, Shard):
        return NodeSharding(REPLICATE)
    if p.dim == len(ctx.shape(node.args[0])) - 1:
        raise Abandon(p.roots, f"{ctx.where(node)} reads sharded (real, imaginary) pairs as complex numbers")
    return NodeSharding(p)


def view_as_real(ctx: RuleContext, node: fx.Node) -> NodeSharding:
    """[..., n] complex -> [..., n, 2] real: every dim keeps its place."""
    return NodeSharding(ctx.place(node.args[0]))


def gathered_param_dim(ctx: RuleContext, v: object, dim: int, reader: fx.Node) -> int | None:
    """The parameter dim behind `dim` of `v` when v = P[ids] gathers rows of a parameter P by one
    index tensor and `reader` is its only reader (so it may read P split instead); else None."""
    if not (isinstance(v, fx.Node) and v.op == "call_function" and op_name(v.target) == "index"
            and list(v.users) == [reader] and len(v.args[1]) == 1 and isinstance(v.args[1][0], fx.Node)):
        return None
    read = ctx.param(v.args[0])
    ids_nd = len(ctx.shape(v.args[1][0]))
    if read is None or read[1] or dim < ids_nd:
        return None
    return dim - ids_nd + 1


def index(ctx: RuleContext, node: fx.Node) -> NodeSharding:
    """x[i0, i1, ..] with index tensors on x's leading dims: a shard past them moves behind the
    indices' broadcast shape; a sharded dim that is indexed, or a sharded index, is refused. A gather
    of parameter rows its reader asked to read split (`split_read`) reads its part of the parameter."""
    split = ctx.split_read(node)
    if split is not None:
        name = ctx.param(node.args[0])[0]
        out_dim = split.param_dim + len(ctx.shape(node.args[1][0])) - 1
        size = int(ctx.shape(node)[out_dim])
        return NodeSharding(Shard(out_dim, size, split.layout, split.roots, None),
                            params=[ParamUse(name, split.param_dim, split.layout)])
    p = ctx.place(node.args[0])
    idx = list(node.args[1])
    sharded_index = [ctx.place(i) for i in idx if isinstance(i, fx.Node) and isinstance(ctx.place(i), Shard)]
    if sharded_index:
        raise Abandon(frozenset().union(*(q.roots for q in sharded_index)), f"{ctx.where(node)} indexes with sharded indices")
    if not isinstance(p, Shard):
        return NodeSharding(REPLICATE)
    if any(i is None for i in idx) or p.dim < len(idx):
        raise Abandon(p.roots, f"{ctx.where(node)} indexes sharded dim {p.dim}")
    out_nd, in_nd = len(ctx.shape(node)), len(ctx.shape(node.args[0]))
    return NodeSharding(moved(p, p.dim + out_nd - in_nd))


def index_add(ctx: RuleContext, node: fx.Node) -> NodeSharding:
    """index_add(self, dim, index, source): rows of source added into self along `dim` (not the
    sharded one). A replicated self (the zeros it starts from) is cut to the shard source has."""
    sp, src = ctx.place(node.args[0]), ctx.place(node.args[3])
    dim = norm_dim(node.args[1], len(ctx.shape(node)))
    lead = sp if isinstance(sp, Shard) else src
    if not isinstance(lead, Shard):
        return NodeSharding(REPLICATE)
    roots = frozenset().union(*(q.roots for q in (sp, src) if isinstance(q, Shard)))
    if lead.dim == dim or isinstance(ctx.place(node.args[2]), Shard):
        raise Abandon(roots, f"{ctx.where(node)} adds rows by index along sharded dim {lead.dim}")
    res = NodeSharding(moved(lead, lead.dim, roots=roots, origin=None))
    for arg, q in ((0, sp), (3, src)):
        if isinstance(q, Shard):
            if (q.dim, q.layout) != (lead.dim, lead.layout):
                raise Abandon(roots, f"{ctx.where(node)} combines differently sharded operands")
        elif int(ctx.shape(node.args[arg])[lead.dim]) != lead.size:
            raise Abandon(roots, f"{ctx.where(node)} would cut a replicated operand at padded positions")
        else:
            res.edits.append(Restrict(arg, lead.dim, lead.layout))
    return res


def pad(ctx: RuleContext, node: fx.Node) -> NodeSharding:
    """constant_pad_nd(x, [left, right, ...] from the last dim back, value): a shard on a dim that
    gets no padding stays where it is; padding the sharded dim is refused."""
    p = ctx.place(node.args[0])
    if not isinstance(p, Shard):
        return NodeSharding(REPLICATE)
    widths = list(node.args[1])
    nd = len(ctx.shape(node.args[0]))
    k = nd - 1 - p.dim                           # the sharded dim's pair in `widths`
    if 2 * k + 1 < len(widths) and (widths[2 * k], widths[2 * k + 1]) != (0, 0):
        raise Abandon(p.roots, f"{ctx.where(node)} pads sharded dim {p.dim}")
    return NodeSharding(p)


def triangle(ctx: RuleContext, node: fx.Node) -> NodeSharding:
    """tril / triu keep a triangle of the last two dims (Qwen3-Next's chunk masks of each head): a
    shard on another dim stays where it is."""
    p = ctx.place(node.args[0])
    if not isinstance(p, Shard):
        return NodeSharding(REPLICATE)
    if p.dim >= len(ctx.shape(node.args[0])) - 2:
        raise Abandon(p.roots, f"{ctx.where(node)} keeps a triangle of its sharded dim {p.dim}")
    return NodeSharding(p)


TENSOR_RULES = {
    "new_empty": new_like, "new_zeros": new_like, "new_ones": new_like, "new_full": new_like,
    "repeat": repeat, "repeat_interleave": repeat_interleave,
    "view_as_complex": view_as_complex, "view_as_real": view_as_real, "index": index, "index_add": index_add,
    "constant_pad_nd": pad, "pad": pad, "tril": triangle, "triu": triangle,
}
