"""Rules for attention: activation x activation matmuls (scores, scores x values) and SDPA.

Queries, keys and values are sharded by heads, a batch dim of these ops. Grouped- and multi-query
attention share kv heads between ranks: a rank then holds (or keeps, of repeated heads) the kv heads
its query heads read, and the shared projection rows have their gradients summed over the ranks.
"""
from __future__ import annotations

import torch.fx as fx

from autoshard.passes.sharding.index_sets import Layout, Ranges, is_partition, is_whole_everywhere, positions_within
from autoshard.passes.sharding.placement import REPLICATE, Abandon, NodeSharding, Restrict, RowParallel, Shard
from autoshard.passes.sharding.rule_context import RuleContext

__all__ = ["ATTENTION_RULES", "activation_matmul"]


def _holds_whole(ctx: RuleContext, p: Shard, roots: frozenset[str], node: fx.Node) -> bool:
    """Multi-query attention: a kv head's features, split by its fused projection's layout, meet
    queries sharded on heads. Every rank must hold the whole head: True once it does, else a Demand
    for that layout (Abandon where the layout is not traceable to its root). The value stays sharded,
    not replicated, so it gets no f: the shared rows' gradients are summed over the ranks instead."""
    if is_whole_everywhere(p.layout, p.size):
        return True
    ctx.require_granularity(p.origin, p.size, p.size, roots,
                            f"{ctx.where(node)}: each rank needs whole kv heads of {p.size} features")


def activation_matmul(ctx: RuleContext, node: fx.Node, *, transposed_b: bool) -> NodeSharding:
    """Activation x activation (attention scores, attention x values): batch dims shard through;
    a sharded contraction gives partial sums, reduced by g; a sharded row of one side shards out."""
    a, b = node.args[0], node.args[1]
    pa, pb = ctx.place(a), ctx.place(b)
    na, nb, no = len(ctx.shape(a)), len(ctx.shape(b)), len(ctx.shape(node))
    roots = frozenset().union(*(p.roots for p in (pa, pb) if isinstance(p, Shard)))
    if not roots:
        return NodeSharding(REPLICATE)
    # Multi-query attention written out: scores or values sharded on heads (a batch dim) meet the one
    # kv head's features; every rank then holds that head whole and it is cut like a replicated side.
    if any(isinstance(p, Shard) and p.dim < nd - 2 for p, nd in ((pa, na), (pb, nb))):
        pa, pb = (REPLICATE if isinstance(p, Shard) and p.dim >= nd - 2 and _holds_whole(ctx, p, roots, node)
                  else p for p, nd in ((pa, na), (pb, nb)))
    # Role of each operand dim: batch dims align right of the last two; then (row, k) and (k, col).
    b_k = nb - 1 if transposed_b else nb - 2
    b_col = nb - 2 if transposed_b else nb - 1
    if isinstance(pa, Shard) and pa.dim == na - 1 and isinstance(pb, Shard) and pb.dim == b_k \
            and pa.layout == pb.layout and is_partition(pa.layout, pa.size):
        return NodeSharding(REPLICATE, role="row", edits=[RowParallel(None)])
    cands: list[tuple[int, Shard]] = []
    for i, (p, nd, row_or_col, out_pos) in enumerate(((pa, na, na - 2, no - 2), (pb, nb, b_col, no - 1))):
        if not isinstance(p, Shard):
            continue
        if p.dim == row_or_col:
            cands.append((i, Shard(out_pos, p.size, p.layout, roots, p.origin)))
        elif p.dim < nd - 2:
            cands.append((i, Shard(p.dim + no - nd, p.size, p.layout, roots, p.origin)))
        else:
            raise Abandon(roots, f"{ctx.where(node)} contracts a sharded dim against a replicated one")
    out, edits = cands[0][1], []
    if len(cands) == 2:
        other = cands[1][1]
        if out.dim != other.dim or out.dim >= no - 2:
            raise Abandon(roots, f"{ctx.where(node)} combines differently sharded operands")
        if out.layout != other.layout:
            met = _batch_layouts_meet(cands, (na, nb), no)
            if met is None:
                raise Abandon(roots, f"{ctx.where(node)} combines differently sharded operands")
            out, cut = met
            edits.append(cut)
    res = NodeSharding(out, edits=edits)
    if out.dim < no - 2:  # a batch dim: the replicated operand must be cut the same way
        for i, (p, nd) in enumerate(((pa, na), (pb, nb))):
            d = out.dim - (no - nd)
            if not isinstance(p, Shard) and d >= 0 and ctx.shape(node.args[i])[d] != 1:
                res.edits.append(Restrict(i, d, out.layout))
    return res


def _batch_layouts_meet(cands: list[tuple[int, Shard]], ndims: tuple[int, int], no: int
                        ) -> tuple[Shard, Restrict] | None:
    """Both sides sharded on one batch dim (heads) with different layouts: where one side holds every
    head the other's rank needs (kv heads shared by ranks and repeated for their query heads, as
    eager attention's repeat_kv does), it keeps just those. The result is sharded like the other."""
    for (_, keep_all), (j, cut) in (cands, cands[::-1]):
        keep = _positions_kept(cut.layout, keep_all.layout)
        if keep is not None:
            return keep_all, Restrict(j, cut.dim - (no - ndims[j]), keep)
    return None


def _positions_kept(held: Layout, needed: Layout) -> Layout | None:
    """Per rank, the local positions of the heads it needs among those it holds; None if one lacks any."""
    keep = tuple(positions_within(h, n) for h, n in zip(held, needed))
    return None if any(k is None for k in keep) else keep


def _groups_line_up(q_heads: Ranges, kv_heads: Ranges, group: int) -> bool:
    """SDPA's enable_gqa on one rank: local query head j reads local kv head j // (nq / nkv); that must
    be the kv head its global index reads (j's global head // group)."""
    qs = [h for a, b in q_heads for h in range(a, b)]
    ks = [h for a, b in kv_heads for h in range(a, b)]
    if len(qs) % len(ks):
        return False
    per = len(qs) // len(ks)
    return all(h // group == ks[j // per] for j, h in enumerate(qs))


def sdpa(ctx: RuleContext, node: fx.Node) -> NodeSharding:
    """q (.., Hq, L, E), k/v (.., Hk, S, E): heads (or batch) shard through; kv may hold more heads."""
    q, k, v = node.args[:3]
    pq = ctx.place(q)
    others = [ctx.place(t) for t in (k, v)]
    if not isinstance(pq, Shard):
        if any(isinstance(p, Shard) for p in others):
            raise Abandon(frozenset().union(*(p.roots for p in others if isinstance(p, Shard))),
                          f"{ctx.where(node)}: keys/values are sharded but queries are not")
        return NodeSharding(REPLICATE)
    nd = len(ctx.shape(q))
    if pq.dim >= nd - 2:
        raise Abandon(pq.roots, f"{ctx.where(node)}: queries sharded along sequence or features")
    roots = pq.roots.union(*(p.roots for p in others if isinstance(p, Shard)))
    res = NodeSharding(Shard(pq.dim, pq.size, pq.layout, roots, pq.origin))
    gqa = node.kwargs.get("enable_gqa", False)
    for i, (t, p) in enumerate(zip((k, v), others), start=1):
        hk = int(ctx.shape(t)[pq.dim])
        group = pq.size // hk if gqa else 1
        needed = tuple(tuple(sorted({(a // group, -(-b // group)) for a, b in rs})) for rs in pq.layout)
        if gqa and group > 1 and not all(_groups_line_up(q, kv, group) for q, kv in zip(pq.layout, needed)):
            raise Abandon(roots, f"{ctx.where(node)}: grouped heads do not line up per rank")
        if not isinstance(p, Shard) or p.dim == nd - 1 != pq.dim and _holds_whole(ctx, p, roots, node):
            if hk > 1:
                res.edits.append(Restrict(i, pq.dim, needed))
            continue
        if p.dim != pq.dim:
            raise Abandon(roots, f"{ctx.where(node)}: keys/values sharded on another dim than queries")
        if p.layout != needed:
            keep = _positions_kept(p.layout, needed)
            if keep is None:
                raise Abandon(roots, f"{ctx.where(node)}: a rank lacks the kv heads its queries need")
            res.edits.append(Restrict(i, pq.dim, keep))
    mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
    if isinstance(mask, fx.Node):
        pm = ctx.place(mask)
        md = pq.dim - (nd - len(ctx.shape(mask)))
        if isinstance(pm, Shard):
            raise Abandon(roots, f"{ctx.where(node)}: sharded attention mask")
        if md >= 0 and ctx.shape(mask)[md] != 1:
            res.edits.append(Restrict(3, md, pq.layout))
    return res


ATTENTION_RULES = {"scaled_dot_product_attention": sdpa}
