"""Before the sharding analysis: experts' matmuls on stacked [experts, ...] weights as ops it knows.

    rewrite_expert_matmuls(gm, param_names)          # the captured graph, edited in place

Two forms, each becoming one op of kernels/expert_matmul_ops.py with the weight read as [experts, in, out]
(directly or through a transpose of its last two dims, as `grouped_mm_fallback` reads it), which
passes/sharding/rules_experts.py splits like a linear layer (column-parallel on out, row-parallel
on in; the experts dim untouched):

- HF's `batched_mm` experts (transformers' `_batched_linear` on a stored [experts, out, in] W):
      squeeze(bmm(index(W, [ids]), unsqueeze(x, -1)), -1)  ->  gathered_linear(x, W.transpose(-2, -1), ids)
  matched when W is a 3-D parameter indexed on its first dim and the gathered rows and the
  unsqueezed input have no other reader;
- an einsum of an activation and a 3-D parameter whose last two dims are the contracted feature c
  and the output feature f (either order), c last in the activation's subscripts, f last in the
  output's, the weight's other letter (the experts) kept in the output:
      einsum("btd,edh->bteh", x, W)  ->  einsum_linear(x, W, "btd,edh->bteh")
- a linear layer on one expert's weight, picked by a Python loop over the experts (JetMoE):
      linear(x, select(W, 0, e))  ->  selected_linear(x, W, e)
  matched when every reader of the selected weight is such a linear layer;
Anything else stays as it is (its weights replicated, reported).
"""
from __future__ import annotations

import torch
import torch.fx as fx

from autoshard.kernels.expert_matmul_ops import einsum_linear, gathered_linear, selected_linear
from autoshard.passes.graph_reading import op_name

__all__ = ["rewrite_expert_matmuls"]


def _only_user(n: fx.Node, user: fx.Node) -> bool:
    return list(n.users) == [user]


def _param3(n: object, param_names: dict[str, str]) -> bool:
    return isinstance(n, fx.Node) and n.op == "get_attr" and n.target in param_names and \
        len(n.meta["val"].shape) == 3


def _transposed(graph: fx.Graph, w: fx.Node, meta: dict) -> fx.Node:
    wt = graph.call_function(torch.ops.aten.transpose.int, (w, -2, -1))
    wt.meta = {**meta, "val": w.meta["val"].transpose(-2, -1)}
    return wt


def _gathered(graph: fx.Graph, sq: fx.Node, param_names: dict[str, str]) -> bool:
    if op_name(sq.target) != "squeeze" or len(sq.args) < 2 or sq.args[1] not in (-1, 2):
        return False
    bmm = sq.args[0]
    if not (isinstance(bmm, fx.Node) and op_name(bmm.target) == "bmm" and _only_user(bmm, sq)):
        return False
    rows, unsq = bmm.args
    if not (op_name(rows.target) == "index" and op_name(unsq.target) == "unsqueeze" and unsq.args[1] in (-1, 2)
            and _only_user(rows, bmm) and _only_user(unsq, bmm)):
        return False
    w, index = rows.args
    if not (_param3(w, param_names) and len(index) == 1 and index[0] is not None):
        return False
    with graph.inserting_before(sq):
        out = graph.call_function(gathered_linear, (unsq.args[0], _transposed(graph, w, rows.meta), index[0]))
    out.meta = dict(sq.meta)
    sq.replace_all_uses_with(out)
    for n in (sq, bmm, rows, unsq):
        graph.erase_node(n)
    return True


def _einsum(graph: fx.Graph, n: fx.Node, param_names: dict[str, str]) -> bool:
    if op_name(n.target) != "einsum" or len(n.args) != 2 or len(n.args[1]) != 2 or "." in n.args[0]:
        return False
    (ins, out_s), (a, b) = n.args[0].replace(" ", "").split("->"), n.args[1]
    subs = ins.split(",")
    if _param3(b, param_names) and not _param3(a, param_names):
        (xs, ws), x, w = subs, a, b
    elif _param3(a, param_names) and not _param3(b, param_names):
        (ws, xs), x, w = subs, b, a
    else:
        return False
    c, f = xs[-1], out_s[-1] if out_s else ""
    batch = set(ws) - {c, f}
    if not (len(set(ws)) == len(ws) == 3 and set(ws[-2:]) == {c, f} and c not in out_s and f not in xs
            and batch <= set(out_s) and set(xs) - {c} <= set(out_s) and set(out_s) <= set(xs) | set(ws)):
        return False
    with graph.inserting_before(n):
        wt = w if ws[-2:] == c + f else _transposed(graph, w, n.meta)
        new = graph.call_function(einsum_linear, (x, wt, f"{xs},{ws[0]}{c}{f}->{out_s}"))
    new.meta = dict(n.meta)
    n.replace_all_uses_with(new)
    graph.erase_node(n)
    return True


def _selected(graph: fx.Graph, sel: fx.Node, param_names: dict[str, str]) -> bool:
    if op_name(sel.target) != "select" or not _param3(sel.args[0], param_names) or sel.args[1] not in (0, -3) \
            or not isinstance(sel.args[2], int) or not sel.users:
        return False
    linears = list(sel.users)
    if any(op_name(u.target) != "linear" or u.args[1] is not sel or sel in u.args[2:] for u in linears):
        return False
    for u in linears:
        with graph.inserting_before(u):
            new = graph.call_function(selected_linear, (u.args[0], sel.args[0], sel.args[2], *u.args[2:]))
        new.meta = dict(u.meta)
        u.replace_all_uses_with(new)
        graph.erase_node(u)
    graph.erase_node(sel)
    return True


def rewrite_expert_matmuls(gm: fx.GraphModule, param_names: dict[str, str]) -> int:
    """Rewrite every match; returns how many."""
    done = 0
    for n in list(gm.graph.nodes):
        if n.op == "call_function" and (_gathered(gm.graph, n, param_names) or _einsum(gm.graph, n, param_names)
                                        or _selected(gm.graph, n, param_names)):
            done += 1
    if done:
        gm.graph.lint()
        gm.recompile()
    return done
