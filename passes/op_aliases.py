"""Before the sharding analysis: ATen's alias ops written as the ops they alias.

    rewrite_op_aliases(gm)          # the captured graph, edited in place; returns how many

`torch.multiply`, `torch.concatenate`, `torch.subtract`, ... export as their own ATen ops
(`aten.multiply.Tensor`, `aten.concatenate.default`), each the same function as another op under
another name. Written as that op, every table that knows the op (sharding rules, FLOP counts, fusion
patterns, context parallelism's token rules) knows the alias too: a model spelled with
`torch.multiply` shards as the same model spelled with `*`. An alias maps overload by overload to the
canonical op's overload of the same name and the same arguments; any other overload is left as
it is (and is refused or replicated as before, naming it).
"""
from __future__ import annotations

import functools

import torch
import torch.fx as fx

__all__ = ["ALIASES", "rewrite_op_aliases"]

aten = torch.ops.aten

# alias op -> the op it is another name of (ATen's native_functions.yaml marks each as an alias)
ALIASES: dict[str, str] = {
    "multiply": "mul", "divide": "div", "true_divide": "div", "subtract": "sub",
    "concatenate": "cat", "concat": "cat",
    "greater": "gt", "greater_equal": "ge", "less": "lt", "less_equal": "le", "not_equal": "ne",
    "negative": "neg", "absolute": "abs", "clip": "clamp", "fix": "trunc", "arctan2": "atan2",
    "moveaxis": "movedim",
}


def _arguments(op) -> list[tuple[str, str]]:
    return [(a.name, str(a.type)) for a in op._schema.arguments]


@functools.cache
def _canonical(alias: str, overload: str):
    """The canonical op's overload for `aten.<alias>.<overload>`, or None where there is none with
    the same arguments."""
    target = ALIASES[alias]
    try:
        mine, theirs = getattr(getattr(aten, alias), overload), getattr(getattr(aten, target), overload)
    except AttributeError:
        return None
    return theirs if _arguments(mine) == _arguments(theirs) else None


def rewrite_op_aliases(gm: fx.GraphModule) -> int:
    """Each call of an alias op becomes the op it aliases; the number rewritten."""
    count = 0
    for node in gm.graph.nodes:
        target = node.target
        if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
            continue
        name = target._schema.name
        if not name.startswith("aten::") or name[len("aten::"):] not in ALIASES:
            continue
        canonical = _canonical(name[len("aten::"):], target._overloadname)
        if canonical is not None:
            node.target = canonical
            count += 1
    if count:
        gm.recompile()
    return count
