"""Causal attention: SDPA calls whose mask is a cached table run SDPA's causal path when it is causal.

    count = specialize_attention(graph, tables)      # after passes/tables.py; graph edited in place

A traced Hugging Face decoder builds its causal mask as a tensor (~35 small ops, now computed once
per shape by the tables cache) and calls `scaled_dot_product_attention(q, repeat_kv(k),
repeat_kv(v), mask)`, where the eager model calls SDPA with `is_causal=True` and `enable_gqa=True`.
The explicit mask costs every attention call a mask conversion, and repeat_kv copies keys and values
(and sums their gradients back). For each SDPA call with no dropout whose mask is a table output:

- the tables body gains an output `is_causal_mask(mask)`, so whether the mask is the lower triangle
  is decided once per shape, on the values, never assumed;
- the call becomes kernels/attention.py's `attention(q, k, v, mask, causal)`: SDPA with
  `is_causal=True` when the flag holds, the explicit mask otherwise;
- keys and values repeated the way repeat_kv does (`x[:, :, None].expand(b, kv, n, s, d).reshape(b,
  kv * n, s, d)`) are passed unrepeated with `repeat=n` (SDPA's `enable_gqa`).

Calls with dropout keep their form (the causal kernel draws its dropout differently).
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from autoshard.kernels.attention import attention, is_causal_mask
from autoshard.passes.outline import take_name
from autoshard.passes.tables import TableRegion

__all__ = ["specialize_attention"]

aten = torch.ops.aten
_FULL = 2 ** 63 - 1


def _arg(node: fx.Node, index: int, name: str, default):
    return node.args[index] if len(node.args) > index else node.kwargs.get(name, default)


def _full_slice(n: object) -> bool:
    """x[..., :, ...]: a slice from 0 to the end, step 1 (an identity view)."""
    return (isinstance(n, fx.Node) and n.target == aten.slice.Tensor and len(n.args) >= 4
            and n.args[2] in (0, None) and isinstance(n.args[3], int) and n.args[3] >= _FULL
            and (len(n.args) < 5 or n.args[4] == 1))


def _same(a: object, b: object) -> bool:
    return a is b or (isinstance(a, int) and isinstance(b, int) and a == b)


def _through_full_slices(n: object) -> object:
    while _full_slice(n):
        n = n.args[0]
    return n


def repeated_kv(n: object) -> tuple[fx.Node, int] | None:
    """(x, n_rep) when `n` is repeat_kv(x): reshape(expand(x[:, :, None], [b, kv, n, s, d]), [b, kv * n, s, d])."""
    if not (isinstance(n, fx.Node) and n.target in (aten.reshape.default, aten.view.default)):
        return None
    ex = n.args[0]
    if not (isinstance(ex, fx.Node) and ex.target == aten.expand.default and len(ex.args[1]) == 5):
        return None
    un = _through_full_slices(ex.args[0])
    if not (isinstance(un, fx.Node) and un.target == aten.unsqueeze.default and un.args[1] == 2):
        return None
    b, kv, rep, s, d = ex.args[1]
    shape = list(n.args[1])
    if not (isinstance(kv, int) and isinstance(rep, int) and len(shape) == 4 and shape[1] == kv * rep
            and _same(shape[0], b) and _same(shape[2], s) and _same(shape[3], d)):
        return None
    return _through_full_slices(un.args[0]), rep


def specialize_attention(graph: fx.Graph, tables: TableRegion | None) -> int:
    """Rewrite the eligible SDPA calls of `graph` (see the module docstring); returns how many."""
    if tables is None:
        return 0
    call = next(n for n in graph.nodes if n.op == "call_module" and n.target == tables.name)
    body_out = next(n for n in tables.graph.nodes if n.op == "output")
    items = {u.args[1]: u for u in call.users if u.target is operator.getitem}
    flags: dict[int, fx.Node] = {}
    count = 0
    for node in list(graph.nodes):
        if node.target != aten.scaled_dot_product_attention.default:
            continue
        q, k, v = node.args[:3]
        mask = _arg(node, 3, "attn_mask", None)
        if (_arg(node, 4, "dropout_p", 0.0) != 0.0 or _arg(node, 5, "is_causal", False)
                or not isinstance(mask, fx.Node) or mask.target is not operator.getitem or mask.args[0] is not call):
            continue
        index = mask.args[1]
        if index not in flags:
            outs = list(body_out.args[0])
            with tables.graph.inserting_before(body_out):
                check = tables.graph.call_function(is_causal_mask, (outs[index],))
            body_out.args = (tuple(outs + [check]),)
            with graph.inserting_after(items[index]):
                flags[index] = graph.create_node("call_function", operator.getitem, (call, len(outs)),
                                                 name=f"{mask.name}_is_causal")
        kw = {"scale": node.kwargs.get("scale"), "enable_gqa": node.kwargs.get("enable_gqa", False)}
        rk, rv = repeated_kv(k), repeated_kv(v)
        if rk and rv and rk[1] == rv[1] and not kw["enable_gqa"]:
            (k, rep), (v, _) = rk, rv
            kw["repeat"] = rep
        name = take_name(node, f"{node.name}_specialized")
        with graph.inserting_before(node):
            new = graph.create_node("call_function", attention, (q, k, v, mask, flags[index]), kw, name=name)
        new.meta = dict(node.meta)
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        count += 1
    graph.eliminate_dead_code(is_impure_node=lambda n: n.op != "call_function" or n.target not in _VIEWS)
    tables.graph.lint()
    graph.lint()
    return count


_VIEWS = {aten.reshape.default, aten.view.default, aten.expand.default, aten.unsqueeze.default, aten.slice.Tensor}
