"""The op table: aten op name -> sharding rule. Adding an op is adding a row in rules_*.py."""
from __future__ import annotations

import operator
from typing import Callable

import torch.fx as fx

from .placement import Abandon, NodeSharding, Shard
from .rules_compute import COMPUTE_RULES, default
from .rules_shape import SHAPE_RULES

__all__ = ["RULES", "rule_for", "op_name"]

RULES: dict[str, Callable] = {**SHAPE_RULES, **COMPUTE_RULES}


def op_name(target: object) -> str:
    if target is operator.getitem:
        return "getitem"
    schema = getattr(target, "_schema", None)
    if schema is not None:
        return schema.name.split("::")[-1]
    return getattr(target, "__name__", str(target))


def _output(ctx, node: fx.Node) -> NodeSharding:
    for a in node.all_input_nodes:
        p = ctx.place(a)
        if isinstance(p, Shard):
            raise Abandon(p.roots, f"{ctx.where(a)} is returned from the model while sharded")
    return NodeSharding()


def rule_for(node: fx.Node) -> Callable:
    if node.op == "output":
        return _output
    if node.op != "call_function":
        return default
    return RULES.get(op_name(node.target), default)
