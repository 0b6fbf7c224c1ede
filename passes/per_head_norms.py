"""Before the sharding analysis: a norm per head, written as a list of modules, as one op.

    rewrite_per_head_norms(gm)          # the captured graph, edited in place; returns how many

The pattern (StableLM's `q_layernorm.norms[i]`):

    pieces = split(x, 1, dim)                      # one piece per head
    out = cat([layer_norm(pieces[i], shape, w_i, b_i, eps) for i in range(H)], dim)

becomes `per_head_layer_norm(x, stack(w_i), stack(b_i), dim, k, eps)` (kernels/norm_ops.py), which
the table splits with the heads. Matched only when every piece goes to its own layer_norm alone,
every norm has the same shape, eps and arguments kind, and the cat takes them in order and nothing
else; anything else stays as written (and is refused or replicated as before).
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from autoshard.kernels.norm_ops import per_head_layer_norm
from autoshard.passes.graph_reading import op_name

__all__ = ["rewrite_per_head_norms"]


def _norms_of(split: fx.Node) -> list[fx.Node] | None:
    """The layer_norm of each piece, in order, or None when the split is not the pattern."""
    if op_name(split.target) != "split" or split.args[1] != 1:
        return None
    getters = sorted(split.users, key=lambda g: g.args[1] if g.target is operator.getitem else -1)
    if len(getters) != len(split.meta["val"]) or any(g.target is not operator.getitem for g in getters):
        return None
    norms = []
    for i, g in enumerate(getters):
        users = list(g.users)
        if g.args[1] != i or len(users) != 1 or op_name(users[0].target) != "layer_norm" or users[0].args[0] is not g:
            return None
        norms.append(users[0])
    return norms


def _same_kind(norms: list[fx.Node]) -> bool:
    def key(n: fx.Node) -> tuple:
        args = list(n.args) + [None] * (5 - len(n.args))
        return tuple(args[1]), args[2] is None, args[3] is None, args[4]
    return len({key(n) for n in norms}) == 1


def _rewrite(gm: fx.GraphModule, split: fx.Node) -> bool:
    norms = _norms_of(split)
    if not norms or not _same_kind(norms):
        return False
    cats = list(norms[-1].users)
    nd = len(split.args[0].meta["val"].shape)
    dim = split.args[2] % nd if len(split.args) > 2 else 0
    if len(cats) != 1 or op_name(cats[0].target) != "cat" or list(cats[0].args[0]) != norms \
            or (cats[0].args[1] if len(cats[0].args) > 1 else 0) % nd != dim \
            or any(list(n.users) != [cats[0]] for n in norms):
        return False
    cat, graph = cats[0], gm.graph
    args = list(norms[0].args) + [None] * (5 - len(norms[0].args))
    shape, eps = list(args[1]), args[4] if args[4] is not None else 1e-5
    with graph.inserting_before(cat):
        stacked = []
        for slot in (2, 3):
            if args[slot] is None:
                stacked.append(None)
                continue
            items = [n.args[slot] for n in norms]
            s = graph.call_function(torch.ops.aten.stack.default, (items, 0))
            s.meta = {**norms[0].meta, "val": torch.stack([i.meta["val"] for i in items])}
            stacked.append(s)
        new = graph.call_function(per_head_layer_norm, (split.args[0], *stacked, dim, len(shape), eps))
    new.meta = dict(cat.meta)
    cat.replace_all_uses_with(new)
    for n in [cat, *norms, *[n.args[0] for n in norms], split]:
        graph.erase_node(n)
    return True


def rewrite_per_head_norms(gm: fx.GraphModule) -> int:
    done = sum(1 for n in list(gm.graph.nodes) if n.op == "call_function" and _rewrite(gm, n))
    if done:
        gm.graph.lint()
        gm.recompile()
    return done
