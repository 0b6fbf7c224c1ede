"""Rules for ops that compute: elementwise arithmetic, matmuls against parameters, attention, norms.

A matmul against a parameter whose input is replicated starts a column-parallel region (its output
features are sharded); one whose input is sharded on the contraction dim is the row-parallel end
of that region (partial sums, reduced by g). Everything between must be in this table.
"""
from __future__ import annotations

import torch.fx as fx

from autoshard.errors import ShardingError
from autoshard.passes.sharding.index_sets import copies, is_partition, joined, local_size, token_tiles
from autoshard.passes.sharding.placement import (
    REPLICATE,
    Abandon,
    ArgEdit,
    ColumnInput,
    GatherTokens,
    NodeSharding,
    Origin,
    ParamUse,
    ReadSplit,
    Restrict,
    RowParallel,
    Shard,
)
from autoshard.passes.sharding.rule_context import RuleContext
from autoshard.passes.sharding.rules_attention import activation_matmul
from autoshard.passes.sharding.rules_shape import moved, norm_dim, sharded_inputs
from autoshard.passes.sharding.rules_tensors import gathered_param_dim

__all__ = ["COMPUTE_RULES", "default", "elementwise", "mm", "param_matmul", "row_parallel_error"]


def _align(ctx: RuleContext, node: fx.Node, tensors: list[tuple[int, int | None, object]]) -> NodeSharding:
    """Elementwise alignment of (arg index, list item, value) operands broadcast to the node's rank."""
    out_nd = len(ctx.shape(node))
    shards = [(ctx.place(v), len(ctx.shape(v))) for _, _, v in tensors]
    lead = next(((p, nd) for p, nd in shards if isinstance(p, Shard)), None)
    if lead is None:
        return NodeSharding(REPLICATE)
    p0, nd0 = lead
    od = p0.dim + out_nd - nd0
    roots = frozenset().union(*(p.roots for p, _ in shards if isinstance(p, Shard)))
    res = NodeSharding(Shard(od, p0.size, p0.layout, roots, p0.origin))
    for (arg, item, v), (p, nd) in zip(tensors, shards):
        d = od - (out_nd - nd)
        if isinstance(p, Shard):
            if p.dim != d or p.layout != p0.layout:
                raise Abandon(roots, f"{ctx.where(node)} combines differently sharded operands"
                                     + (_shared_with_split(ctx, p0, p) if p.dim == d else ""))
            continue
        if d < 0 or ctx.shape(v)[d] == 1:
            continue  # broadcast along the sharded dim
        if p0.size != int(ctx.shape(v)[d]):
            raise Abandon(roots, f"{ctx.where(node)} would cut a replicated operand at padded positions")
        prm = ctx.param(v)
        gathered = gathered_param_dim(ctx, v, d, node) if prm is None else None
        if prm is not None and not prm[1]:
            res.params.append(ParamUse(prm[0], d, p0.layout))
        elif gathered is not None:        # B[ids] read only here: read B split instead of cutting B[ids]
            raise ReadSplit(v.name, gathered, p0.layout, roots)
        else:
            res.edits.append(Restrict(arg, d, p0.layout, item=item))
    return res


def _shared_with_split(ctx: RuleContext, a: Shard, b: Shard) -> str:
    """What two layouts of one dim that differ are, when one holds blocks shared by ranks and the
    other splits the dim over them (Mamba-2's B and C from groups fewer than tp, met by the heads)."""
    held = {copies(a.layout, a.size), copies(b.layout, b.size)}
    shared = max((c for c in held if c is not None), default=1)
    if shared == 1 or 1 not in held:
        return ""
    return (f": one is held by {shared} ranks at a time (blocks fewer than tp={ctx.tp}, such as Mamba groups), "
            f"the other split over them; the blocks must divide by tp={ctx.tp} to be split with the other")


def elementwise(ctx: RuleContext, node: fx.Node) -> NodeSharding:
    if not hasattr(node.meta.get("val"), "shape"):     # torch.where(cond): a tuple of index tensors
        return default(ctx, node)
    tensors = [(i, None, a) for i, a in enumerate(node.args) if isinstance(a, fx.Node) and "val" in a.meta
               and hasattr(a.meta["val"], "shape")]
    return _align(ctx, node, tensors)


def _read_split(ctx: RuleContext, res: NodeSharding, v: object, arg: int, dim: int, layout,
                item: int | None = None) -> None:
    """A replicated operand read at this rank's indices of `dim`: a parameter (as stored) split with
    them, anything else cut to them in the rank graph."""
    prm = ctx.param(v)
    if prm is not None and not prm[1]:
        res.params.append(ParamUse(prm[0], dim, layout))
    else:
        res.edits.append(Restrict(arg, dim, layout, item=item))


def cat(ctx: RuleContext, node: fx.Node) -> NodeSharding:
    items = [(0, i, a) for i, a in enumerate(node.args[0])]
    dim = norm_dim(node.args[1] if len(node.args) > 1 else 0, len(ctx.shape(node)))
    along = _cat_of_shards(ctx, node, node.args[0], dim)
    if along is not None:
        return along
    res = _align(ctx, node, items)
    if isinstance(res.placement, Shard) and res.placement.dim == dim:
        raise Abandon(res.placement.roots, f"{ctx.where(node)} concatenates along a sharded dim")
    return res


def gather(ctx: RuleContext, node: fx.Node) -> NodeSharding:
    """gather(x, dim, index): the output has index's shape, and along every other dim index and x
    meet element by element (DeBERTa-v2's relative-position scores, gathered along the keys with
    an index broadcast over the heads): aligned as elementwise operands are, a replicated one cut
    to this rank's heads. Along the gathered dim a shard is refused."""
    dim = norm_dim(node.args[1], len(ctx.shape(node)))
    res = _align(ctx, node, [(0, None, node.args[0]), (2, None, node.args[2])])
    if isinstance(res.placement, Shard) and res.placement.dim == dim:
        raise Abandon(res.placement.roots, f"{ctx.where(node)} gathers along sharded dim {dim}")
    return res


def _cat_of_shards(ctx: RuleContext, node: fx.Node, items: list, dim: int) -> NodeSharding | None:
    """cat([a, b, ...], dim) with every item sharded on `dim` and laid out differently (Qwen3-Next's
    head-split q, k and v joined for one convolution): each rank's pieces, in item order, are its
    indices of the joined dim, item i's shifted by the sizes before it. None otherwise: items laid
    out alike keep cat's refusal, after which a reshape may read the other way (one kv head's
    rotate_half: the shard on the head, not on the halves it joins)."""
    places = [ctx.place(a) for a in items]
    if not places or not all(isinstance(p, Shard) and p.dim == dim for p in places) \
            or len({p.layout for p in places}) == 1:
        return None
    dims = [ctx.shape(a)[dim] for a in items]
    roots = frozenset().union(*(p.roots for p in places))
    if not all(n.is_Integer and p.size == int(n) for p, n in zip(places, dims)):
        raise Abandon(roots, f"{ctx.where(node)} concatenates along a sharded dim of symbolic or padded size")
    sizes = [int(n) for n in dims]
    return NodeSharding(Shard(dim, sum(sizes), joined([p.layout for p in places], sizes), roots, None))


def stack(ctx: RuleContext, node: fx.Node) -> NodeSharding:
    """stack(tensors, dim): the items (all one shape) aligned as cat aligns them; the output has a
    new dim at `dim`, so an item's sharded dim d is the output's d, or d + 1 from `dim` on."""
    res = _align(ctx, node, [(0, i, a) for i, a in enumerate(node.args[0])])
    p = res.placement
    if not isinstance(p, Shard):
        return res
    new = norm_dim(node.args[1] if len(node.args) > 1 else 0, len(ctx.shape(node)))
    item_dim = p.dim - 1                  # _align placed it as if broadcast from the right
    res.placement = moved(p, item_dim + (1 if item_dim >= new else 0))
    return res


def row_parallel_error(ctx: RuleContext, node: fx.Node, p: Shard) -> Exception:
    return ShardingError(
        f"tp={ctx.tp} cannot split the input of {ctx.where(node)}: its {p.size} features would be "
        f"shared between ranks (blocks fewer than ranks), so the row-parallel sum would count them "
        f"twice. The attention heads (or blocks: a linear attention's key-head groups) feeding it must be "
        f"divisible by tp={ctx.tp}; they come from "
        f"{', '.join(ctx.where(r) for r in sorted(p.roots))}. Key/value heads fewer than tp can be shared "
        f"by ranks; query heads cannot.")


def param_matmul(ctx: RuleContext, node: fx.Node, x_arg: int, w_arg: int, w_out_dim: int,
                 bias_arg: int | None, weight: tuple[str, int, int] | None = None) -> NodeSharding:
    """x @ W with W a parameter; `w_out_dim` is W's output-feature dim (0 for linear, 1 for mm).
    `weight` = (parameter, its output-feature dim, its input-feature dim) as stored, for a weight
    read other than directly or through a 2-D transpose (an expert stack [experts, out, in])."""
    x = node.args[x_arg]
    w_shape = ctx.shape(node.args[w_arg])
    if weight is None:
        w_name, transposed = ctx.param(node.args[w_arg])
        w_out = w_out_dim ^ int(transposed)   # dim of the stored parameter
        w_in = 1 - w_out
    else:
        w_name, w_out, w_in = weight
    w_size = int(w_shape[-1 - w_out_dim])      # input features, as passed ([.., out, in] or [.., in, out])
    bias = node.args[bias_arg] if bias_arg is not None and len(node.args) > bias_arg else None
    b_name = ctx.param(bias)[0] if bias is not None and ctx.param(bias) is not None else None
    p = ctx.place(x)
    nd = len(ctx.shape(node))
    gather = None
    if isinstance(p, Shard) and p.dim != len(ctx.shape(x)) - 1 and ctx.options.sequence_parallel:
        outer = token_tiles(p.layout, p.size, ctx.tp)
        if outer is None:
            raise Abandon(p.roots, f"{ctx.where(node)}: sequence shards not in rank order")
        gather = GatherTokens(x_arg, p.dim, outer)   # sequence-parallel tokens: gather them
        ctx.note_tokens(node, x, p)
        p = REPLICATE
    if not isinstance(p, Shard):
        size = int(ctx.shape(node)[-1])
        found = ctx.root_layout(node, size, (w_name, w_out))
        if found is None or (bias is not None and b_name is None):
            # a replicated matmul on sequence shards: gather the tokens, compute the same everywhere
            keep = GatherTokens(gather.arg, gather.dim, gather.outer, reduce_grads=False) if gather else None
            return NodeSharding(REPLICATE, edits=[keep] if keep is not None else [])
        layout, padded = found
        res = NodeSharding(Shard(nd - 1, padded or size, layout, frozenset([node.name]), Origin(node.name, 0, 1)),
                           role="column", edits=[e for e in (gather, ColumnInput(x_arg)) if e is not None])
        res.params.append(ParamUse(w_name, w_out, layout, padded))
        if b_name is not None:
            res.params.append(ParamUse(b_name, 0, layout, padded))
        return res
    if p.dim != len(ctx.shape(x)) - 1:  # a token dim: every row is computed where it lives
        return NodeSharding(Shard(p.dim, p.size, p.layout, p.roots, p.origin))
    if not is_partition(p.layout, p.size):
        raise row_parallel_error(ctx, node, p)
    tokens = ctx.tokens_for(node, p.roots) if ctx.options.sequence_parallel else None
    scatter = None
    out_place = REPLICATE
    if tokens is not None:      # end the region with a reduce-scatter onto the sequence shards
        dim, seq = tokens
        scatter = (dim, token_tiles(seq.layout, seq.size, ctx.tp))
        out_place = Shard(dim, seq.size, seq.layout, seq.roots, None)
    res = NodeSharding(out_place, role="row",
                       edits=[RowParallel(bias_arg if bias is not None else None, scatter=scatter)])
    res.params.append(ParamUse(w_name, w_in, p.layout, p.size if p.size != w_size else None))
    return res


def linear(ctx: RuleContext, node: fx.Node) -> NodeSharding:
    if ctx.param(node.args[1]) is None:
        return _activation_matmul(ctx, node, transposed_b=True)
    return param_matmul(ctx, node, 0, 1, 0, 2)


def addmm(ctx: RuleContext, node: fx.Node) -> NodeSharding:
    if ctx.param(node.args[2]) is None or len(ctx.shape(node.args[0])) != 1:
        return default(ctx, node)
    return param_matmul(ctx, node, 1, 2, 1, 0)


def mm(ctx: RuleContext, node: fx.Node) -> NodeSharding:
    a, b = node.args[:2]
    if ctx.param(b) is not None and len(ctx.shape(b)) == 2:
        return param_matmul(ctx, node, 0, 1, 1, None)
    if ctx.param(a) is not None and len(ctx.shape(a)) == 2 and not isinstance(ctx.place(b), Shard) \
            and len(ctx.shape(node)) >= 2:
        return _weight_first(ctx, node)
    return _activation_matmul(ctx, node, transposed_b=False)


def _weight_first(ctx: RuleContext, node: fx.Node) -> NodeSharding:
    """W @ x with W [out, in] a parameter and x [.., in, n] replicated (Mamba-1's
    `dt_proj.weight @ time_step.transpose(1, 2)`): a column-parallel root whose output features are
    the result's dim -2, W split by its rows."""
    w_name, transposed = ctx.param(node.args[0])
    nd = len(ctx.shape(node))
    size = int(ctx.shape(node)[nd - 2])
    found = ctx.root_layout(node, size, (w_name, int(transposed)))
    if found is None or found[1] is not None:
        return NodeSharding(REPLICATE)
    layout = found[0]
    res = NodeSharding(Shard(nd - 2, size, layout, frozenset([node.name]), Origin(node.name, 0, 1)),
                       role="column", edits=[ColumnInput(1)])
    res.params.append(ParamUse(w_name, int(transposed), layout))
    return res


def _activation_matmul(ctx: RuleContext, node: fx.Node, *, transposed_b: bool) -> NodeSharding:
    if any(len(ctx.shape(x)) < 2 for x in node.args[:2]):
        return default(ctx, node)
    return activation_matmul(ctx, node, transposed_b=transposed_b)


def sym_size(ctx: RuleContext, node: fx.Node) -> NodeSharding:
    p = ctx.place(node.args[0])
    if isinstance(p, Shard) and norm_dim(node.args[1], len(ctx.shape(node.args[0]))) == p.dim:
        raise Abandon(p.roots, f"{ctx.where(node)} reads the size of a sharded dim")
    return NodeSharding(REPLICATE)


def default(ctx: RuleContext, node: fx.Node) -> NodeSharding:
    shards = sharded_inputs(ctx, node)
    if shards:
        raise Abandon(frozenset().union(*(p.roots for p in shards)),
                      f"{ctx.where(node)}: no sharding rule for {node.target}")
    return NodeSharding(REPLICATE)


_ELEMENTWISE = (
    "add", "sub", "rsub", "mul", "div", "where", "eq", "ne", "lt", "le", "gt", "ge", "maximum",
    "minimum", "pow", "masked_fill", "__and__", "__or__", "logical_and", "logical_or", "fmod",
    "remainder", "clamp_min", "clamp_max", "copysign", "atan2", "lerp", "addcmul", "addcdiv",
    "bitwise_and", "bitwise_or", "hypot", "xlogy", "gelu_backward", "threshold",
)

def einsum(ctx: RuleContext, node: fx.Node) -> NodeSharding:
    """einsum over activations (and parameters) where the split dim is a batch-like subscript: one
    that every operand holding it keeps and the output keeps (Mamba-2's chunked scan, "bclhn,bcshn->
    bclsh", split by the heads h). Operands that hold the subscript unsplit are read at this rank's
    indices (a parameter split with it); a split subscript summed over, or two operands split on
    different subscripts, is refused."""
    equation, operands = node.args[0], list(node.args[1])
    if not isinstance(equation, str) or "..." in equation or "->" not in equation:
        return default(ctx, node)
    ins, out = equation.replace(" ", "").split("->")
    subs = ins.split(",")
    if len(subs) != len(operands):
        return default(ctx, node)
    split = [(i, ctx.place(v)) for i, v in enumerate(operands) if isinstance(ctx.place(v), Shard)]
    if not split:
        return NodeSharding(REPLICATE)
    roots = frozenset().union(*(p.roots for _, p in split))
    letters = {subs[i][p.dim] for i, p in split}
    p0 = split[0][1]
    if len(letters) != 1 or any(p.layout != p0.layout for _, p in split):
        raise Abandon(roots, f"{ctx.where(node)} ({equation}) combines operands split along different dims")
    (letter,) = letters
    if letter not in out:
        raise Abandon(roots, f"{ctx.where(node)} ({equation}) sums over its split subscript {letter!r}")
    res = NodeSharding(Shard(out.index(letter), p0.size, p0.layout, roots, p0.origin))
    for i, v in enumerate(operands):
        if isinstance(ctx.place(v), Shard) or letter not in subs[i]:
            continue
        d = subs[i].index(letter)
        if ctx.shape(v)[d] != p0.size:
            raise Abandon(roots, f"{ctx.where(node)} ({equation}) would cut operand {i} at padded positions")
        _read_split(ctx, res, v, 1, d, p0.layout, item=i)
    return res


_GROUPS = 6          # conv1d(input, weight, bias, stride, padding, dilation, groups): both overloads


def depthwise_conv1d(ctx: RuleContext, node: fx.Node) -> NodeSharding:
    """A depthwise convolution (groups == channels, weight [channels, 1, k]: Mamba's and the short
    convolutions' causal conv over the sequence) of input [batch, channels, length] sharded by
    channel: each channel is its own convolution, so each rank convolves its channels with its rows
    of the weight and bias, and its `groups` is its channel count. Any other convolution of a
    sharded input mixes channels across ranks and is refused, saying which it is."""
    x, w = node.args[0], node.args[1]
    p = ctx.place(x)
    if not isinstance(p, Shard):
        return default(ctx, node)
    shape, w_shape = ctx.shape(x), ctx.shape(w)
    channel = len(shape) - 2                                # [batch, C, L], or [C, L] unbatched
    channels = int(shape[channel])
    groups = node.args[_GROUPS] if len(node.args) > _GROUPS else node.kwargs.get("groups", 1)
    depthwise = groups == channels and int(w_shape[0]) == channels and int(w_shape[1]) == 1
    if p.dim != channel or not depthwise:
        what = (f"its input is split along dim {p.dim}, not its channels" if p.dim != channel else
                f"not depthwise: groups={groups}, weight {[int(s) for s in w_shape]} for {channels} channels, so "
                f"each output channel reads input channels other ranks hold")
        raise Abandon(p.roots, f"{ctx.where(node)}: a convolution splits by channel only when depthwise; "
                               + what)
    w_prm = ctx.param(w)
    local = local_size(p.layout)
    if w_prm is None or w_prm[1] or local is None or len(node.args) <= _GROUPS:
        why = ("its weight is not a parameter read as stored" if w_prm is None or w_prm[1] else
               "ranks would hold different channel counts" if local is None else "its groups is not a positional argument")
        raise Abandon(p.roots, f"{ctx.where(node)}: a depthwise convolution split by channel, but {why}")
    res = NodeSharding(Shard(channel, p.size, p.layout, p.roots, p.origin))
    res.params.append(ParamUse(w_prm[0], 0, p.layout))
    bias = node.args[2] if len(node.args) > 2 else None
    if isinstance(bias, fx.Node):
        _read_split(ctx, res, bias, 2, 0, p.layout)
    res.edits.append(ArgEdit(_GROUPS, (local,) * ctx.tp))
    return res


COMPUTE_RULES = {
    **{name: elementwise for name in _ELEMENTWISE},
    "cat": cat, "stack": stack, "linear": linear, "addmm": addmm, "mm": mm, "matmul": mm, "bmm": mm,
    "sym_size": sym_size, "conv1d": depthwise_conv1d, "einsum": einsum, "gather": gather,
}
