"""Rules for ops that reduce a dim: sums and means, maxima with their indices, top-k, softmax, norms.

A reduction over a dim that is not sharded keeps the shard where it is (moved left by the dims it
drops). One over the sharded dim is refused, except a mean or sum over the sharded feature dim that
a norm takes of all heads' features (OLMo 2's q/k RMSNorm): each rank reduces its own features and
the statistic is summed over the ranks through g (`PartialStatistic`), so the projections before
it stay split; so is a norm between two projections of full width (BitNet's sub-norms, a norm over
an MLP's hidden features). Where the normalized value goes straight into another weight's matmul
from a projection narrower than its input (MLA's q_a and kv_a latents, DeepSeek), that projection is
a low-rank down-projection: Megatron keeps those whole, and so does this table, saying so ("by
design"). A router's top-k over its experts is kept whole for the same reason.
"""
from __future__ import annotations

import sympy
import torch.fx as fx

from autoshard.passes.graph_reading import op_name
from autoshard.passes.sharding.index_sets import copies, local_size
from autoshard.passes.sharding.placement import REPLICATE, Abandon, NodeSharding, PartialStatistic, Restrict, Shard
from autoshard.passes.sharding.rule_context import RuleContext
from autoshard.passes.sharding.rules_compute import elementwise
from autoshard.passes.sharding.rules_shape import moved, norm_dim

__all__ = ["REDUCE_RULES"]

_MATMULS = frozenset(["linear", "addmm", "mm", "matmul", "bmm"])
_ATTENTION = frozenset(["scaled_dot_product_attention"])
_LOOKAHEAD = 40      # nodes visited when asking where a normalized value goes


def _kept(p: Shard, dims: list[int], keepdim: bool) -> Shard:
    """The shard after reducing `dims` (none of them sharded)."""
    return moved(p, p.dim if keepdim else p.dim - sum(1 for x in dims if x < p.dim))


def _dims(ctx: RuleContext, node: fx.Node, dims: list[int]) -> list[int]:
    nd = len(ctx.shape(node.args[0]))
    return [norm_dim(d, nd) for d in dims] if dims else list(range(nd))


def _reduce_over(ctx: RuleContext, node: fx.Node, dims: list[int], keepdim: bool) -> NodeSharding:
    p = ctx.place(node.args[0])
    if not isinstance(p, Shard):
        return NodeSharding(REPLICATE)
    dims = _dims(ctx, node, dims)
    if p.dim in dims:
        raise Abandon(p.roots, f"{ctx.where(node)} reduces over sharded dim {p.dim}")
    return NodeSharding(_kept(p, dims, keepdim))


def _reaches(node: fx.Node, found, stop) -> bool:
    """Whether a value computed from `node` meets a node `found(n)` is true of, within _LOOKAHEAD
    nodes, not going past nodes `stop(n)` is true of."""
    seen, frontier = {node}, list(node.users)
    while frontier and len(seen) < _LOOKAHEAD:
        u = frontier.pop(0)
        if u in seen or u.op != "call_function":
            continue
        seen.add(u)
        if found(u):
            return True
        if not stop(u):
            frontier.extend(u.users)
    return False


def _feeds_weight(ctx: RuleContext, node: fx.Node) -> bool:
    """Whether the value this statistic normalizes reaches a matmul against a parameter before it is
    viewed into heads or meets attention: a norm between a down- and an up-projection."""
    def weight_matmul(u: fx.Node) -> bool:
        return op_name(u.target) in _MATMULS and any(ctx.param(a) is not None for a in u.args[1:3])

    def heads_or_attention(u: fx.Node) -> bool:
        name = op_name(u.target)
        return name in _ATTENTION or name in _MATMULS or \
            (name in ("view", "reshape", "_unsafe_view") and _splits_features(u))
    return _reaches(node, weight_matmul, heads_or_attention)


def _low_rank(ctx: RuleContext, roots: frozenset[str]) -> bool:
    """Whether every projection that starts the region narrows its input (MLA's q_a: hidden ->
    q_lora_rank): a down-projection Megatron keeps whole. A norm between two projections of full
    width (BitNet's attn_sub_norm before o_proj, ffn_sub_norm before down_proj) is a distributed norm."""
    def narrows(name: str) -> bool:
        root = ctx.node(name)
        if op_name(root.target) not in _MATMULS or not isinstance(root.args[0], fx.Node):
            return False
        out, x = ctx.shape(root), ctx.shape(root.args[0])
        return bool(out and x and (out[-1] < x[-1]) is sympy.true)
    return bool(roots) and all(narrows(r) for r in roots)


def _unless_upstream_whole(ctx: RuleContext, node: fx.Node, roots: frozenset[str]) -> None:
    """A projection that is a column-parallel root only because its input is whole (Bloom's and
    DeBERTa's attention output dense after their attention fell back; Megatron splits it
    row-parallel) is not kept whole by design: say that it follows from that fallback."""
    cause = ctx.whole_upstream(roots)
    if cause is not None:
        raise Abandon(roots, f"{ctx.where(node)} normalizes the output of a projection that feeds another weight; "
                             f"its input is whole because {', '.join(cause.modules)} stayed whole (see its "
                             f"reason), so it is not split row-parallel either")


def _splits_features(node: fx.Node) -> bool:
    src, dst = node.args[0].meta["val"].shape, node.meta["val"].shape
    return len(dst) == 0 or len(src) == 0 or dst[-1] != src[-1]


def _statistic(ctx: RuleContext, node: fx.Node, p: Shard, dims: list[int], mean: bool) -> NodeSharding:
    """A mean or sum over exactly the sharded feature dim, summed over the ranks (see the module doc)."""
    nd = len(ctx.shape(node.args[0]))
    local = local_size(p.layout)
    shared = copies(p.layout, p.size)
    if dims != [p.dim] or p.dim != nd - 1 or local is None or shared is None:
        raise Abandon(p.roots, f"{ctx.where(node)} reduces over sharded dim {p.dim}")
    if _feeds_weight(ctx, node) and _low_rank(ctx, p.roots):
        _unless_upstream_whole(ctx, node, p.roots)
        raise Abandon(p.roots, f"{ctx.where(node)} normalizes the output of a low-rank down-projection that "
                               f"feeds another weight; kept whole, as Megatron keeps these", by_design=True)
    # key/value heads fewer than tp (OLMo 3's k_norm at tp=4 over 2 kv heads): each feature is held by
    # `shared` ranks, so the ranks' sum counts it that many times
    return NodeSharding(REPLICATE, role="statistic",
                        edits=[PartialStatistic((local / p.size if mean else 1.0) / shared)])


def reduction(ctx: RuleContext, node: fx.Node) -> NodeSharding:
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", [])
    dims = [dims] if isinstance(dims, int) else list(dims or [])
    keep = bool(node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False))
    p = ctx.place(node.args[0])
    name = op_name(node.target)
    if isinstance(p, Shard) and name in ("mean", "sum") and p.dim in (reduced := _dims(ctx, node, dims)):
        return _statistic(ctx, node, p, reduced, name == "mean")
    return _reduce_over(ctx, node, dims, keep)


def max_min(ctx: RuleContext, node: fx.Node) -> NodeSharding:
    """max / min: `.dim` gives (values, indices) over a dim, `.other` is elementwise, `.default`
    reduces everything."""
    overload = node.target._overloadname
    if overload == "other":
        return elementwise(ctx, node)
    if overload == "dim":
        keep = bool(node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False))
        res = _reduce_over(ctx, node, [node.args[1]], keep)
        return NodeSharding((res.placement, res.placement))
    return _reduce_over(ctx, node, [], False)


def arg_reduction(ctx: RuleContext, node: fx.Node) -> NodeSharding:
    """argmax / argmin over a dim (None: all dims)."""
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    keep = bool(node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False))
    return _reduce_over(ctx, node, [] if dim is None else [dim], keep)


def topk(ctx: RuleContext, node: fx.Node) -> NodeSharding:
    """topk(x, k, dim): (values, indices) with k entries along `dim`. Over the sharded dim it is a
    router choosing experts: whole by design."""
    p = ctx.place(node.args[0])
    if not isinstance(p, Shard):
        return NodeSharding((REPLICATE, REPLICATE))
    dim = norm_dim(node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", -1), len(ctx.shape(node.args[0])))
    if dim == p.dim:
        raise Abandon(p.roots, f"{ctx.where(node)} picks the top {node.args[1]} along sharded dim {p.dim} "
                               f"(a router's choice of experts); kept whole, as Megatron keeps routers", by_design=True)
    return NodeSharding((p, p))


def softmax(ctx: RuleContext, node: fx.Node) -> NodeSharding:
    """Over a sharded dim it is refused; where its probabilities go to a top-k, it is a router's
    softmax over its experts (Mixtral, Qwen-MoE), whole by design."""
    p = ctx.place(node.args[0])
    if isinstance(p, Shard) and norm_dim(node.args[1], len(ctx.shape(node))) == p.dim and \
            _reaches(node, lambda u: op_name(u.target) == "topk", lambda u: False):
        raise Abandon(p.roots, f"{ctx.where(node)} takes a softmax over sharded dim {p.dim} that a top-k "
                               f"reads (a router over its experts); kept whole, as Megatron keeps routers", by_design=True)
    return _reduce_over(ctx, node, [node.args[1]], True)


def layer_norm(ctx: RuleContext, node: fx.Node) -> NodeSharding:
    """A fused norm over the last k dims: over a sharded one it is refused; where it normalizes a
    projection whose output then feeds another weight (BERT's masked-LM head transform), by design."""
    nd = len(ctx.shape(node))
    k = len(node.args[1])
    p = ctx.place(node.args[0])
    if isinstance(p, Shard) and p.dim >= nd - k and _feeds_weight(ctx, node):
        _unless_upstream_whole(ctx, node, p.roots)
        raise Abandon(p.roots, f"{ctx.where(node)} normalizes the output of a projection that feeds another "
                               f"weight; kept whole, as Megatron keeps these", by_design=True)
    return _reduce_over(ctx, node, list(range(nd - k, nd)), True)


def per_head_norm(ctx: RuleContext, node: fx.Node) -> NodeSharding:
    """kernels/norm_ops.py's per_head_layer_norm(x, w [H, ..], b [H, ..], dim, k, eps): sharded on
    the heads dim, each rank norms its heads with their rows of w and b; over a normalized dim, refused."""
    p = ctx.place(node.args[0])
    if not isinstance(p, Shard):
        return NodeSharding(REPLICATE)
    dim, k = node.args[3], node.args[4]
    if p.dim >= len(ctx.shape(node)) - k:
        raise Abandon(p.roots, f"{ctx.where(node)} norms over sharded dim {p.dim}")
    if p.dim != dim:
        return NodeSharding(p)
    return NodeSharding(p, edits=[Restrict(i, 0, p.layout) for i in (1, 2) if node.args[i] is not None])


def scan(ctx: RuleContext, node: fx.Node) -> NodeSharding:
    """cumsum / cumprod / logcumsumexp along a dim (Mamba-2's segment sums over a chunk's positions):
    each element depends on its predecessors along that dim only, so a shard on another dim (the
    heads) stays where it is; along the sharded dim it would need the other ranks' prefixes."""
    p = ctx.place(node.args[0])
    if not isinstance(p, Shard):
        return NodeSharding(REPLICATE)
    if norm_dim(node.args[1], len(ctx.shape(node.args[0]))) == p.dim:
        raise Abandon(p.roots, f"{ctx.where(node)} scans along sharded dim {p.dim}")
    return NodeSharding(p)


REDUCE_RULES = {
    "sum": reduction, "mean": reduction, "amax": reduction, "amin": reduction, "var": reduction,
    "std": reduction, "prod": reduction, "max": max_min, "min": max_min, "argmax": arg_reduction,
    "argmin": arg_reduction, "topk": topk, "_softmax": softmax, "softmax": softmax, "log_softmax": softmax,
    "_log_softmax": softmax, "layer_norm": layer_norm, "native_layer_norm": layer_norm, "rms_norm": layer_norm,
    "per_head_layer_norm": per_head_norm, "cumsum": scan, "cumprod": scan, "logcumsumexp": scan,
}
