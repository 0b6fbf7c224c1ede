"""Global shapes for the context-parallel pass, as sympy expressions in the sequence length.

Captured nodes carry example values with symbolic sizes; the nodes the tensor-parallel rewrite
adds (f, g, the vocabulary-parallel embedding's masking, bounds checks, a rank's heads of a table) carry
none, so their shapes are inferred here from their inputs': per element (broadcast), like their
first input (f, g, dropout's modules, a vocabulary gather: token dims are untouched), an unsqueeze,
a part of one dim (a size of its own), a scalar loss. Anything else is unknown (None), which the pass treats as "no rule".
"""
from __future__ import annotations

from typing import Callable

import sympy
import torch
import torch.fx as fx

from autoshard.passes.context.tokens import ELEMENTWISE, module_rule

__all__ = ["exprs", "infer_shape"]

aten = torch.ops.aten
_CUTS = {aten.slice.Tensor, aten.narrow.default, aten.index_select.default, aten.select.int}


def exprs(v: object) -> list | None:
    """A tensor's sizes as sympy expressions (None for anything else), each Max / Min that its
    symbols' lower bounds decide replaced by the side that wins: MPT's ALiBi rows are sliced from
    `max(0, 1 - S)`, which is 0 for every S >= 2 the export allows (the row dim is 1, no token dim)."""
    if not isinstance(v, torch.Tensor):
        return None
    return [_refined(s) if isinstance(s, torch.SymInt) else sympy.Integer(int(s)) for s in v.shape]


def _refined(size: torch.SymInt) -> sympy.Expr:
    from torch.utils._sympy.functions import Max, Min       # the classes torch's size expressions use
    e = sympy.sympify(size.node.expr)
    if not e.has(Max, Min):
        return e
    ranges = size.node.shape_env.var_to_range
    shift = {}
    for sym in e.free_symbols:
        low = ranges.get(sym)
        low = getattr(low, "lower", None)
        if low is not None and low.is_integer and low.is_finite:     # sym = low + t, t >= 0
            shift[sym] = sympy.Integer(int(low)) + sympy.Symbol(f"_{sym}_above", nonnegative=True, integer=True)
    if not shift:
        return e

    def decide(node):
        if len(node.args) != 2:
            return node
        a, b = node.args
        d = sympy.expand((a - b).subs(shift))
        if d.is_nonnegative:
            return a if isinstance(node, Max) else b
        if d.is_nonpositive:
            return b if isinstance(node, Max) else a
        return node
    return e.replace(lambda x: isinstance(x, (Max, Min)), decide)


def infer_shape(n: fx.Node, shape: Callable[[object], list | None]) -> list | None:
    if n.op == "call_module":
        kind = module_rule(n.target)
        if kind == "loss":
            return []
        return shape(n.args[0]) if kind in ("elementwise", "gather_module") else None
    if n.op != "call_function":
        return None
    if getattr(n.target, "__module__", "") == "autoshard.bounds":     # checks that return their input
        return shape(n.args[0])
    if n.target == aten.unsqueeze.default:
        s = shape(n.args[0])
        if s is None:
            return None
        d = n.args[1] % (len(s) + 1)
        return [*s[:d], sympy.Integer(1), *s[d:]]
    if n.target in _CUTS:               # a rank's part of a dim (tensor parallelism's heads): a size of its own
        s = shape(n.args[0])
        if s is None:
            return None
        d = (n.args[1] if len(n.args) > 1 else 0) % len(s)
        return [*s[:d], *([] if n.target == aten.select.int else [sympy.Dummy("part")]), *s[d + 1:]]
    if n.target in ELEMENTWISE or torch.Tag.pointwise in getattr(n.target, "tags", ()):
        shapes = [shape(a) for a in n.all_input_nodes]
        if any(s is None for s in shapes):
            return None
        return _broadcast(shapes)
    return None


def _broadcast(shapes: list[list]) -> list:
    nd = max((len(s) for s in shapes), default=0)
    out = []
    for i in range(nd):
        sizes = {s[i - nd + len(s)] for s in shapes if i - nd + len(s) >= 0} - {sympy.Integer(1)}
        out.append(sizes.pop() if len(sizes) == 1 else sympy.Integer(1) if not sizes else max(sizes, key=str))
    return out
