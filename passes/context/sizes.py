"""Sizes of a context-parallel rank's values: a size written with the sequence length S becomes this
rank's S / cp where the value holds only the rank's tokens.

`fix_sizes(sp)` rewrites every size list (tokens.py's `SIZE_ARG`: views, expands, new_* tensors) of
a computed value at its LOCAL token dims: a size node becomes `size // cp` (`local_size`, one per
size node), and in a static graph (sequence parallelism, passes/context/split.py's `symbolic`) an
integer size is divided by cp. `static_size` reads an expression in S at the example's length.
"""
from __future__ import annotations

import operator

import sympy
import torch
import torch.fx as fx

from autoshard.errors import ShardingError
from autoshard.passes.context.tokens import LOCAL, SIZE_ARG

__all__ = ["expr_of", "local_size", "fix_sizes", "static_size"]


def expr_of(v: object) -> sympy.Expr | None:
    """A size's value (SymInt or int) as a sympy expression."""
    if isinstance(v, torch.SymInt):
        return sympy.sympify(v.node.expr)
    if isinstance(v, int):
        return sympy.Integer(v)
    return None


def local_size(sp, s: fx.Node) -> fx.Node:
    """The node computing this rank's share of size node `s` (s // cp), which must be proportional
    to the sequence length."""
    if s not in sp.sizes:
        expr = expr_of(sp.value(s))
        seq = next(iter(sp.seqs & expr.free_symbols), None) if expr is not None else None
        if seq is None or len(sp.seqs & expr.free_symbols) > 1 or \
                sympy.simplify(expr - seq * sympy.diff(expr, seq)) != 0:
            raise ShardingError(f"cp={sp.cp}: size {s.name} = {expr} is not proportional to the sequence "
                                "length; the pass cannot give a rank's share of it")
        with sp.graph.inserting_after(s):
            sp.sizes[s] = sp.graph.call_function(operator.floordiv, (s, sp.cp))
    return sp.sizes[s]


def static_size(sp, e: sympy.Expr) -> int:
    """A static graph's size `e` (an expression in the sequence length) at the example's length."""
    return int(e.subs({s: sp.seq_value for s in sp.seqs}))


def fix_sizes(sp) -> None:
    for n in list(sp.graph.nodes):
        if n not in sp.computed or n.target not in SIZE_ARG or not isinstance(sp.tags.get(n), tuple):
            continue
        i = SIZE_ARG[n.target]
        sizes = list(n.args[i])
        tags = sp.tags[n]
        changed = False
        for d, s in enumerate(sizes):
            if d >= len(tags) or tags[d] != LOCAL:
                continue
            if isinstance(s, fx.Node):
                sizes[d] = local_size(sp, s)
                changed = True
            elif sp.symbolic is not None and isinstance(s, int) and s != -1:     # a static graph's size
                if s % sp.cp:
                    sp.refuse(n, f"its size {s} along dim {d} (this rank's tokens) is not a multiple of cp")
                sizes[d] = s // sp.cp
                changed = True
        if changed:
            n.args = (*n.args[:i], sizes, *n.args[i + 1:])
