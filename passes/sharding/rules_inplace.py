"""Rules for in-place ops (add_, mul_, copy_, masked_fill_, clamp_, ...): their functional forms'.

torch.export keeps a model's in-place ops (transformers' grouped experts add their bias with
`out.add_(bias)`; DeepSeek builds its keys in a `new_empty` tensor with `copy_` into slices). Each
rank's graph repeats the op on its own shard, so the rule is the functional form's, with one more
condition: the tensor written to keeps its placement. Sharded values written into a replicated
tensor would leave ranks holding different "replicated" values, so that region is refused.
"""
from __future__ import annotations

from typing import Callable

import torch.fx as fx

from autoshard.passes.sharding.placement import Abandon, NodeSharding, Shard
from autoshard.passes.sharding.rule_context import RuleContext
from autoshard.passes.sharding.rules_compute import elementwise
from autoshard.passes.sharding.rules_shape import passthrough

__all__ = ["INPLACE_RULES", "INPLACE_FORMS"]


def _in_place(functional: Callable) -> Callable:
    def rule(ctx: RuleContext, node: fx.Node) -> NodeSharding:
        res = functional(ctx, node)
        written = ctx.place(node.args[0])
        if not _same_split(res.placement, written):
            roots = frozenset().union(*(p.roots for p in (res.placement, written) if isinstance(p, Shard)))
            raise Abandon(roots, f"{ctx.where(node)} writes {res.placement} values into a tensor placed "
                                 f"{written} ({node.target} in place)")
        return res
    rule.__name__ = f"in_place_{functional.__name__}"
    return rule


def _same_split(a: object, b: object) -> bool:
    if isinstance(a, Shard) and isinstance(b, Shard):
        return (a.dim, a.size, a.layout) == (b.dim, b.size, b.layout)
    return not isinstance(a, Shard) and not isinstance(b, Shard)


# in-place op -> its functional form's rule
INPLACE_FORMS: dict[str, Callable] = {
    **{f"{name}_": elementwise for name in ("add", "sub", "mul", "div", "copy", "masked_fill", "clamp_min",
                                              "clamp_max", "where", "pow", "addcmul", "addcdiv", "lerp")},
    **{f"{name}_": passthrough for name in ("clamp", "fill", "zero", "neg", "exp", "sigmoid", "tanh", "relu",
                                              "sqrt", "rsqrt", "abs", "floor", "ceil", "round")},
}

INPLACE_RULES = {name: _in_place(rule) for name, rule in INPLACE_FORMS.items()}
