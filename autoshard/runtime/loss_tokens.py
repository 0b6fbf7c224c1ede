"""How many tokens a rank graph's loss averages over, read from its inputs alone.

A mean cross-entropy over a batch is (sum of per-token losses) / (tokens whose label is not
ignore_index). Averaging the means of microbatches (or of data-parallel ranks) differs from that as
soon as labels of -100 are spread unevenly (padding, prompts in fine-tuning). The pipeline therefore
weights microbatch i's mean by n_i / N, with N all-reduced over the data-parallel group, which
needs each n_i before the schedule runs (1F1B starts backwards before the last forward). `n_i`
comes from the graph itself: the cross-entropy's target is computed from the inputs (HF causal LMs
shift the labels inside the model), so that part of the graph is cut out and run on its own.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from autoshard.world import Group, current

__all__ = ["LossTokens", "loss_factors", "loss_tokens", "loss_tokens_of"]

aten = torch.ops.aten


@dataclass(frozen=True)
class LossTokens:
    output: int                                 # index of the mean cross-entropy among the flat outputs
    count: Callable[..., torch.Tensor]          # the flat inputs -> tokens whose target is counted


def _mean_cross_entropy(gm: fx.GraphModule, n: fx.Node) -> tuple[fx.Node, int] | None:
    """(target node, ignore_index) if `n` is a mean cross-entropy without class weights."""
    if n.op == "call_module" and n.target.startswith("vocab_cross_entropy"):
        mod = gm.get_submodule(n.target)
        return (n.args[1], mod.ignore_index) if mod.reduction == 1 else None
    if n.op == "call_function" and n.target == aten.cross_entropy_loss.default:
        args = list(n.args) + [None] * (6 - len(n.args))
        weight = n.kwargs.get("weight", args[2])
        reduction = n.kwargs.get("reduction", 1 if args[3] is None else args[3])
        ignore = n.kwargs.get("ignore_index", -100 if args[4] is None else args[4])
        return (args[1], ignore) if weight is None and reduction == 1 else None
    return None


def loss_tokens(gm: fx.GraphModule) -> LossTokens | None:
    """The token count of `gm`'s loss, when `gm` returns exactly one mean cross-entropy and its
    target depends on the inputs only (no parameter, no collective); else None."""
    found = [(n, hit) for n in gm.graph.nodes if (hit := _mean_cross_entropy(gm, n)) is not None]
    if len(found) != 1:
        return None
    loss, (target, ignore_index) = found[0]
    out = next(n for n in gm.graph.nodes if n.op == "output")
    flat_outs = list(out.args[0]) if isinstance(out.args[0], (list, tuple)) else [out.args[0]]
    if loss not in flat_outs:
        return None
    needed: list[fx.Node] = []
    seen: set[fx.Node] = set()

    def visit(n: fx.Node) -> bool:
        if n in seen:
            return True
        seen.add(n)
        if n.op == "call_module":
            return False
        if n.op == "get_attr" and _is_param(gm, n.target):
            return False
        if not all(visit(a) for a in n.all_input_nodes):
            return False
        needed.append(n)
        return True

    if not visit(target):
        return None
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            env[n] = g.placeholder(n.name)
    for n in needed:
        if n.op != "placeholder":
            env[n] = g.node_copy(n, env.__getitem__)
    counted = g.call_function(aten.sum.default, (g.call_function(aten.ne.Scalar, (env[target], ignore_index)),))
    g.output(counted)
    return LossTokens(flat_outs.index(loss), fx.GraphModule(gm, g, class_name="LossTokens"))


def loss_tokens_of(gm: fx.GraphModule) -> LossTokens | None:
    """`loss_tokens(gm)`, read from the graph once and kept with it (`gm.meta`)."""
    if "loss_tokens" not in gm.meta:
        gm.meta["loss_tokens"] = loss_tokens(gm)
    return gm.meta["loss_tokens"]


def _is_param(gm: fx.GraphModule, target: str) -> bool:
    try:
        gm.get_parameter(target)
        return True
    except AttributeError:
        return False


def loss_factors(counter: LossTokens | None, flats: list[list], goals: list, has_loss_fn: bool, reduction: str,
                 ignore_index: int, dp_group: Group | None, device: torch.device | None
                 ) -> tuple[list[torch.Tensor | float], bool]:
    """Each microbatch's loss factor, and whether they average per token over the global batch (then
    they sum to one over all data-parallel ranks, whose counts are summed over `dp_group`; else
    they sum to one on each rank). `counter` reads the model's own mean cross-entropy (None: the
    model's loss is not one); a loss_fn's "sum" counts the targets not equal to `ignore_index`."""
    m = len(flats)
    if not has_loss_fn and counter is not None:
        counts = [counter.count(*flat).to(torch.float64) for flat in flats]
    elif has_loss_fn and reduction == "sum":
        counts = [sum(((t != ignore_index).sum() for t in pytree.tree_leaves(goal)
                       if isinstance(t, torch.Tensor)), torch.zeros((), dtype=torch.int64)).to(torch.float64)
                  for goal in goals]
    else:
        return [1.0 / m] * m, False
    counts_t = torch.stack(counts).to(device)
    total = counts_t.sum()
    if dp_group is not None:
        current().all_reduce(total, group=dp_group)
    if not has_loss_fn:        # the model's mean over n_i tokens, weighted n_i / N
        return [c / total for c in counts_t], True
    return [1.0 / total] * m, True       # loss_fn's sum, over N
