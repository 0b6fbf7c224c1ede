"""Before the sharding analysis: HF's `batched_mm` experts matmul as one op the analysis knows.

    rewrite_gathered_experts(gm, param_names)        # the captured graph, edited in place

The pattern, per projection (transformers' `_batched_linear` on a stacked [experts, out, in] weight):

    w_rows = aten.index(W, [ids])                    # [S, out, in]: each row's expert
    y = aten.squeeze(aten.bmm(w_rows, aten.unsqueeze(x, -1)), -1)      # [S, out]

becomes `gathered_linear(x, W.transpose(-2, -1), ids)` (kernels/experts.py), the same values.
Matched only when W is a 3-D parameter indexed on its first dim, and the gathered rows and the
unsqueezed input have no other reader.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from autoshard.kernels.experts import gathered_linear
from autoshard.passes.graph_reading import op_name

__all__ = ["rewrite_gathered_experts"]


def _only_user(n: fx.Node, user: fx.Node) -> bool:
    return list(n.users) == [user]


def rewrite_gathered_experts(gm: fx.GraphModule, param_names: dict[str, str]) -> int:
    """Rewrite every match; returns how many."""
    graph, done = gm.graph, 0
    for sq in list(graph.nodes):
        if sq.op != "call_function" or op_name(sq.target) != "squeeze" or len(sq.args) < 2 or sq.args[1] not in (-1, 2):
            continue
        bmm = sq.args[0]
        if not (isinstance(bmm, fx.Node) and op_name(bmm.target) == "bmm" and _only_user(bmm, sq)):
            continue
        rows, unsq = bmm.args
        if not (op_name(rows.target) == "index" and op_name(unsq.target) == "unsqueeze" and unsq.args[1] in (-1, 2)
                and _only_user(rows, bmm) and _only_user(unsq, bmm)):
            continue
        w, index = rows.args
        if not (w.op == "get_attr" and w.target in param_names and len(index) == 1 and index[0] is not None
                and len(w.meta["val"].shape) == 3):
            continue
        with graph.inserting_before(sq):
            wt = graph.call_function(torch.ops.aten.transpose.int, (w, -2, -1))
            out = graph.call_function(gathered_linear, (unsq.args[0], wt, index[0]))
        wt.meta = {**rows.meta, "val": w.meta["val"].transpose(-2, -1)}
        out.meta = dict(sq.meta)
        sq.replace_all_uses_with(out)
        for n in (sq, bmm, rows, unsq):
            graph.erase_node(n)
        done += 1
    if done:
        graph.lint()
        gm.recompile()
    return done
