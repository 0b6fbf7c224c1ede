"""The op table: aten op name -> sharding rule. Adding an op is adding a row in rules_*.py."""
from __future__ import annotations

from typing import Callable

import torch.fx as fx

from autoshard.passes.graph_reading import op_name
from autoshard.passes.sharding.rules_attention import ATTENTION_RULES
from autoshard.passes.sharding.rules_compute import COMPUTE_RULES, default
from autoshard.passes.sharding.rules_experts import EXPERT_RULES
from autoshard.passes.sharding.rules_inplace import INPLACE_RULES
from autoshard.passes.sharding.rules_reduce import REDUCE_RULES
from autoshard.passes.sharding.rules_shape import PASSTHROUGH, SHAPE_RULES
from autoshard.passes.sharding.rules_slices import SLICE_RULES
from autoshard.passes.sharding.rules_tensors import TENSOR_RULES
from autoshard.passes.sharding.rules_vocab import VOCAB_RULES, output

__all__ = ["RULES", "PADDING_SAFE", "rule_for"]

RULES: dict[str, Callable] = {**SHAPE_RULES, **SLICE_RULES, **TENSOR_RULES, **COMPUTE_RULES, **REDUCE_RULES, **INPLACE_RULES,
                              **ATTENTION_RULES, **VOCAB_RULES, **EXPERT_RULES}

# Ops that leave the padded columns of a padded shard (a vocabulary tp does not divide) harmless:
# they map them to padded columns (unary, same-layout elementwise, 1:1 views), or zero their
# contribution (row-parallel matmul against zero rows), or mask them (cross-entropy, gather).
# The rules for these check the rest (reshape: 1:1 only; elementwise: no replicated operand cut).
PADDING_SAFE = frozenset(
    [*PASSTHROUGH, "view", "reshape", "_unsafe_view", "transpose", "t", "permute", "unsqueeze", "getitem",
    "add", "sub", "mul", "div", "where", "linear", "addmm", "mm", "matmul", "cross_entropy_loss",
    "add_", "sub_", "mul_", "div_", "copy_", "view_as_complex", "view_as_real", "new_empty", "new_zeros"])


def rule_for(node: fx.Node) -> Callable:
    if node.op == "output":
        return output
    if node.op != "call_function":
        return default
    return RULES.get(op_name(node.target), default)
