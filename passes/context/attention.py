"""Where tokens meet tokens: matmuls and SDPA under context parallelism (rules of passes/context/split.py).

A product whose keys' side holds this rank's tokens only is given every token: the operand is
all-gathered in position order (`gather_keys`). Two forms are read:
- written out: `q @ k^T` with k's token dim LOCAL (the scores' key dim), and `probs @ v` where the
  contraction meets GLOBAL keys on one side and LOCAL values on the other;
- SDPA: q stays LOCAL, k and v are gathered, the mask table is cut to the rank's query rows, and
  `is_causal=True` becomes `causal_attention_at` with the rank's positions (SDPA's own causal mask
  is the top-left triangle of [local queries, all keys], which is not causality here).
A contraction over LOCAL tokens on both sides (a linear-attention k^T v) is refused.
"""
from __future__ import annotations

import math

import torch
import torch.fx as fx

from autoshard.kernels.attention import causal_attention_at
from autoshard.parallel.context_parallel import ContextGatherSpec
from autoshard.parallel.ring_attention import RingAttentionSpec
from autoshard.passes.causal_attention import repeated_kv
from autoshard.passes.context.rules import cut_tables
from autoshard.passes.context.tokens import GLOBAL, LOCAL, ORDERED_VIEWS, PERMUTES

__all__ = ["matmul_tags", "attention_tags", "gather_keys"]

aten = torch.ops.aten
_THROUGH = ORDERED_VIEWS | PERMUTES | {aten.contiguous.default, aten.clone.default}


def matmul_tags(sp, n: fx.Node) -> None:
    """matmul / bmm / mm / baddbmm / addmm: a [.., m, k] @ b [.., k, n] (+ c broadcast)."""
    offset = 1 if n.target in (aten.baddbmm.default, aten.addmm.default) else 0
    a, b = n.args[offset:offset + 2]
    for x in (a, b):
        if x not in sp.computed and sp.token_dims(sp.shape(x)):
            sp.refuse(n, f"a table ({x.name}) multiplies a value computed from parameters along its tokens")
    sa, sb = sp.shape(a), sp.shape(b)
    if len(sa) < 2 or len(sb) < 2:
        if sp.token_dims(sa) or sp.token_dims(sb):
            sp.refuse(n, "a vector product over tokens")
    ta, tb = list(sp.tags[a]), list(sp.tags[b])
    if tb[-1] == LOCAL:                       # keys: the scores' key dim must hold every token
        b = gather_keys(sp, b, len(sb) - 1, n)
        tb = list(sp.tags[b])
    if sp.is_token(sa[-1]):
        if ta[-1] == LOCAL:
            sp.refuse(n, "it sums over this rank's tokens only (a contraction over the sequence)")
        if tb[-2] == LOCAL:                   # values meeting probabilities over every key
            b = gather_keys(sp, b, len(sb) - 2, n)
            tb = list(sp.tags[b])
    out = sp.shape(n)
    batch = len(out) - 2
    tags = [None] * len(out)
    for i in range(batch):
        found = {t for t in (_at(ta, i - batch + len(ta) - 2), _at(tb, i - batch + len(tb) - 2)) if t}
        if len(found) > 1:
            sp.refuse(n, f"batch dim {i} holds different tokens on each side")
        tags[i] = found.pop() if found else None
    tags[-2], tags[-1] = ta[-2], tb[-1]
    sp.tags[n] = tuple(tags)
    if offset:
        cut_tables(sp, n, [n.args[0]] if n.args[0] not in sp.computed else [], tags)


def _at(tags: list, i: int):
    return tags[i] if 0 <= i < len(tags) else None


def attention_tags(sp, n: fx.Node) -> None:
    q, k, v = n.args[:3]
    qt = sp.tags.get(q)
    if q not in sp.computed or qt[-2] != LOCAL:
        sp.refuse(n, "its queries do not hold this rank's tokens")
    mask = n.args[3] if len(n.args) > 3 else n.kwargs.get("attn_mask")
    out_tags = tuple(qt)
    if isinstance(mask, fx.Node):
        shape = sp.shape(mask)
        if mask in sp.computed:
            mt = sp.tags[mask]
            if mt[-2] not in (LOCAL, None) or mt[-1] == LOCAL:
                sp.refuse(n, "its mask is computed from parameters and does not hold [this rank's queries, every key]")
        elif sp.is_token(shape[-2]):
            n.replace_input_with(mask, sp.cut_table(mask, [len(shape) - 2], before=n))
    causal = n.kwargs.get("is_causal", n.args[5] if len(n.args) > 5 else False)
    if isinstance(mask, fx.Node) and causal:
        sp.refuse(n, "SDPA with both a mask and is_causal=True")
    dropout = n.kwargs.get("dropout_p", n.args[4] if len(n.args) > 4 else 0.0)
    if _mode(sp, q, k) == "ring" and dropout == 0.0:
        return _ring(sp, n, q, k, v, n.args[3] if len(n.args) > 3 else n.kwargs.get("attn_mask"), causal)
    kg = gather_keys(sp, k, len(sp.shape(k)) - 2, n) if sp.tags[k][-2] == LOCAL else k
    vg = gather_keys(sp, v, len(sp.shape(v)) - 2, n) if sp.tags[v][-2] == LOCAL else v
    if causal:
        kw = {"dropout_p": dropout, "scale": n.kwargs.get("scale"), "enable_gqa": n.kwargs.get("enable_gqa", False)}
        with sp.graph.inserting_before(n):
            new = sp.graph.call_function(causal_attention_at, (q, kg, vg, sp.positions_node()), kw)
        return _replace(sp, n, new)
    n.replace_input_with(k, kg) if kg is not k else None
    if vg is not v:
        n.replace_input_with(v, vg)
    sp.tags[n] = out_tags


def _mode(sp, q: fx.Node, k: fx.Node) -> str:
    """"ring" or "all_gather" for an SDPA call: the pass's `attention`, or with "auto" its `choose`'s
    pick for the example sizes of the call's queries and keys ("ring" when they are unknown)."""
    if sp.attention != "auto":
        return sp.attention
    vq, vk = sp.value(q), sp.value(k)
    if sp.choose is None or not (isinstance(vq, torch.Tensor) and isinstance(vk, torch.Tensor)):
        return "ring"
    b, h, s, e = (int(x.node.hint) if isinstance(x, torch.SymInt) else int(x) for x in vq.shape)
    return sp.choose(dict(batch=b, seq=s, heads=h, kv_heads=int(vk.shape[1]), head_dim=e))


def _ring(sp, n: fx.Node, q: fx.Node, k: fx.Node, v: fx.Node, mask: object, causal: bool) -> None:
    """SDPA -> ring attention (parallel/ring_attention.py): q, this rank's keys and values (before
    GQA's repetition: fewer bytes around the ring), its positions and the mask cut to its rows."""
    if not (sp.tags[k][-2] == LOCAL and sp.tags[v][-2] == LOCAL):
        sp.refuse(n, "its keys or values do not hold this rank's tokens")
    rk, rv = repeated_kv(k), repeated_kv(v)
    if rk and rv and rk[1] == rv[1]:
        k, v = rk[0], rv[0]
    scale = n.kwargs.get("scale")              # keyword-only in SDPA's schema
    if scale is None:
        scale = 1.0 / math.sqrt(int(sp.shape(q)[-1]))
    name = f"cp_ring_{n.name}{sp.suffix}"
    has_mask = isinstance(mask, fx.Node)
    sp.cut.specs.append(RingAttentionSpec(name, sp.cp, float(scale), bool(causal), has_mask))
    args = (q, k, v, sp.positions_node(), *((mask,) if has_mask else ()))
    with sp.graph.inserting_before(n):
        new = sp.graph.create_node("call_module", name, args, {}, name=f"{n.name}_ring")
    _replace(sp, n, new)


def _replace(sp, n: fx.Node, new: fx.Node) -> None:
    """`new` takes the SDPA call `n`'s place: its meta, its users, the queries' token tags."""
    new.meta = dict(n.meta)
    sp.computed.add(new)
    sp.tags[new] = tuple(sp.tags[n.args[0]])
    sp.shapes[new] = sp.shape(n)
    n.replace_all_uses_with(new)
    sp.graph.erase_node(n)


def gather_keys(sp, operand: fx.Node, dim: int, consumer: fx.Node) -> fx.Node:
    """`operand` (LOCAL along `dim`) with every token along it, in position order. The gather goes
    back through single-use views (GQA's repeat, transposes) to the smallest tensor, then those
    views are re-tagged GLOBAL along the gathered dim. Returns the node `consumer` now reads."""
    chain: list[tuple[fx.Node, int]] = []         # (view node, its dim that becomes GLOBAL)
    cur, d = operand, dim
    while (cur.op == "call_function" and cur.target in _THROUGH and len(cur.users) == 1
           and isinstance(cur.args[0], fx.Node) and cur.args[0] in sp.computed):
        src = cur.args[0]
        back = _dim_before(sp, cur, src, d)
        if back is None or not sp.is_seq(sp.shape(src)[back]):
            break
        chain.append((cur, d))
        cur, d = src, back
    if not sp.is_seq(sp.shape(cur)[d]):
        sp.refuse(consumer, f"the keys ({cur.name}) hold tokens along a flattened dim {d}")
    name = f"cp_gather_{cur.name}{sp.suffix}"
    sp.cut.specs.append(ContextGatherSpec(name, d, sp.cp))
    with sp.graph.inserting_after(cur):
        gathered = sp.graph.create_node("call_module", name, (cur,), {}, name=f"{cur.name}_all_tokens")
    sp.computed.add(gathered)
    sp.shapes[gathered] = sp.shape(cur)
    sp.tags[gathered] = _with(sp.tags[cur], d, GLOBAL)
    user = chain[-1][0] if chain else consumer
    user.replace_input_with(cur, gathered)
    for node, dd in reversed(chain):
        sp.tags[node] = _with(sp.tags[node], dd, GLOBAL)
    return operand if chain else gathered


def _with(tags: tuple, d: int, tag: str) -> tuple:
    t = list(tags)
    t[d] = tag
    return tuple(t)


def _dim_before(sp, node: fx.Node, src: fx.Node, d: int) -> int | None:
    """The dim of `src` that `node`'s token dim `d` comes from."""
    nd = len(sp.shape(src))
    if node.target == aten.transpose.int:
        a, b = node.args[1] % nd, node.args[2] % nd
        return b if d == a else a if d == b else d
    if node.target == aten.permute.default:
        return node.args[1][d] % nd
    if node.target == aten.t.default:
        return nd - 1 - d
    ours = sp.token_dims(sp.shape(node))
    theirs = sp.token_dims(sp.shape(src))
    if node.target == aten.expand.default and len(ours) > len(theirs):
        return None
    if len(ours) != len(theirs) or d not in ours:
        return None
    return theirs[ours.index(d)]
