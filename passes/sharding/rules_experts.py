"""Rules for mixture-of-experts matmuls: each expert's projections split over tp like a dense MLP's.

Hugging Face's MoE decoders (transformers 5: Mixtral, Qwen3-MoE, OLMoE, ...) keep all experts'
weights in one 3-D parameter, [experts, out, in], and run the tokens routed to each expert (sorted
by expert; `offs` the cumulative counts) through the custom op
`transformers::grouped_mm_fallback(x [tokens, in], W [experts, in, out], offs)`, W being the
parameter transposed on its last two dims. Its semantics, per expert e: rows offs[e-1]:offs[e] of
the output are x[those rows] @ W[e]. So it is a matmul against a parameter in the two feature
dims, and the rule is the linear one: a replicated input starts a column-parallel region (the
parameter split on its output-feature dim, every expert alike), an input sharded on its features
ends one (split on the input-feature dim, the partial sums reduced by g after the op). The experts
dim and `offs` are untouched: every rank runs every expert on its slice of the features.
`gathered_linear` (HF's batched_mm experts, one expert per row) and `einsum_linear` (an einsum
against the stacked weight), both put in place by passes/expert_matmuls.py, are split the same way.
"""
from __future__ import annotations

import torch.fx as fx

from autoshard.passes.sharding.placement import NodeSharding
from autoshard.passes.sharding.rule_context import RuleContext
from autoshard.passes.sharding.rules_compute import default, mm, param_matmul

__all__ = ["EXPERT_RULES", "expert_weight"]


def expert_weight(ctx: RuleContext, w: object) -> tuple[str, int, int] | None:
    """(parameter, output-feature dim, input-feature dim) as stored, when `w` is a 3-D parameter
    read as [experts, in, out]: directly, or transposed on its last two dims from [experts, out, in]."""
    read = ctx.param(w)
    if read is None or len(ctx.shape(w)) != 3:
        return None
    name, transposed = read
    return (name, 1, 2) if transposed else (name, 2, 1)


def grouped_mm(ctx: RuleContext, node: fx.Node) -> NodeSharding:
    weight = expert_weight(ctx, node.args[1])
    if weight is None or len(ctx.shape(node.args[0])) != 2:
        return default(ctx, node)
    return param_matmul(ctx, node, 0, 1, 1, None, weight=weight)


def stacked_matmul(ctx: RuleContext, node: fx.Node) -> NodeSharding:
    """kernels/expert_matmul_ops.py's gathered_linear(x [S, in], W [experts, in, out], ids) and
    einsum_linear(x [..., in], W [experts, in, out], equation [..., out]): the features are x's last
    dim and the output's last, so the split is grouped_mm's for any rank of x."""
    weight = expert_weight(ctx, node.args[1])
    if weight is None:
        return default(ctx, node)
    return param_matmul(ctx, node, 0, 1, 1, None, weight=weight)


def selected_matmul(ctx: RuleContext, node: fx.Node) -> NodeSharding:
    """kernels/expert_matmul_ops.py's selected_linear(x, W [experts, out, in], e, bias): a linear
    layer on one expert's weight, split like one (W on dim 1 or 2, every expert alike)."""
    read = ctx.param(node.args[1])
    if read is None or read[1] or len(ctx.shape(node.args[1])) != 3:
        return default(ctx, node)
    return param_matmul(ctx, node, 0, 1, 0, 3, weight=(read[0], 1, 2))


def batched_matmul(ctx: RuleContext, node: fx.Node) -> NodeSharding:
    """bmm(x [experts, tokens, in], W [experts, in, out]) with W a stacked parameter (Llama 4's
    experts: every expert runs on its own rows of x): split as stacked_matmul; otherwise mm's rule."""
    if expert_weight(ctx, node.args[1]) is not None and len(ctx.shape(node.args[0])) == 3:
        return stacked_matmul(ctx, node)
    return mm(ctx, node)


EXPERT_RULES = {"grouped_mm_fallback": grouped_mm, "gathered_linear": stacked_matmul, "einsum_linear": stacked_matmul,
                "selected_linear": selected_matmul, "bmm": batched_matmul, "matmul": batched_matmul}
