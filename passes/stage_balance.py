"""Stage cuts balanced by cost: how many of the repeated layers each pipeline stage runs.

    costs = layer_costs(graph, rates)               # LayerCosts: per layer, before and after them
    counts = balanced_counts(costs, n_stages)       # [layers of stage 0, layers of stage 1, ...]
    costs.stage_seconds(counts)                     # each stage's predicted forward seconds

Each node of the captured graph (the whole model; the api multiplies the rates by tp, each rank
doing 1/tp of the work) is priced from its own shapes (its meta value; symbolic sizes at the
example's): a matmul-like op (`_FLOPS`) its FLOPs at the target's GEMM rate, any other op that
makes a tensor the bytes of its result at its memory rate (`Rates`: the api reads both off the
hardware profile). A node inside layer i counts for layer i;
a node outside the layers counts for the first stage when the graph reaches it before the first
layer (the embedding) and for the last stage otherwise (the final norm, the head, the loss): what
Megatron's `--account-for-embedding-in-pipeline-split` and `--account-for-loss-in-pipeline-split`
approximate by hand with one layer's worth each. Backward is taken as twice the forward for every
op, so balancing the forwards balances F + B + W.

`phase_costs` prices the backward's two halves as a zero-bubble schedule runs them (B: the input
gradients, W: the weights'; runtime/backward_split.py): a matmul reading a weight costs its FLOPs
once in each (the input-gradient and the weight-gradient matmul), a matmul of two activations (the
attention scores) twice in B; any other op twice its forward bytes, split evenly between B and W
when it reads a weight (a norm's scale: its gradient is a reduction as large as the output) and all
in B otherwise. The planner's schedule choice reads them (planning/schedule_choice.py).

The cut minimises the largest stage's cost over all contiguous cuts (dynamic programming over the
layers, every stage at least one layer). A cut no better than the even layer counts of
passes/stages.layers_per_stage by more than `_MARGIN` is not taken: the prices are estimates, and an
even cut is what people expect when the layers dominate.
"""
from __future__ import annotations

from dataclasses import dataclass
from math import prod

import torch
import torch.fx as fx

from autoshard.passes.graph_reading import op_name
from autoshard.passes.stages import find_layers, layer_of, layers_per_stage

__all__ = ["LayerCosts", "Rates", "layer_costs", "phase_costs", "balanced_counts", "boundary_bytes"]

_MARGIN = 0.05      # a balanced cut must lower the largest stage's cost by 5% to replace the even one


def _val(a) -> object:
    return a.meta.get("val") if isinstance(a, fx.Node) else None


class _Shapes:
    """Sizes as ints: symbolic ones at the example's values; a size known only at run time (JetMoE's
    tokens per expert, read with tolist()) as the example's token count, about what a mixture of
    experts' sorted (token, slot) pairs hold per slot."""

    def __init__(self, unknown: int):
        self.unknown = unknown

    def size(self, d) -> int:
        if isinstance(d, torch.SymInt):
            return int(d.node.hint) if d.node.hint is not None else self.unknown
        return int(d)

    def of(self, a) -> list[int]:
        v = _val(a) if isinstance(a, fx.Node) else a
        return [self.size(d) for d in v.shape] if isinstance(v, torch.Tensor) else []


def _linear(n: fx.Node, out: list[int], sh: _Shapes) -> float:
    return 2.0 * prod(out) * sh.of(n.args[1])[-1]                 # weight [out, in]


def _contract(n: fx.Node, out: list[int], sh: _Shapes, a: int = 0) -> float:
    return 2.0 * prod(out) * sh.of(n.args[a])[-1]                 # a [.., m, k] @ b [.., k, n]


def _attention(n: fx.Node, out: list[int], sh: _Shapes) -> float:
    return 4.0 * prod(sh.of(n.args[0])) * sh.of(n.args[1])[-2]   # QK^T and PV: 2 * 2 * B H Tq Tk D


def _conv(n: fx.Node, out: list[int], sh: _Shapes) -> float:
    return 2.0 * prod(out) * prod(sh.of(n.args[1])[1:])          # weight [out, in / groups, k]


# matmul-like ops: FLOPs from the node and its output's shape
_FLOPS = {"linear": _linear, "mm": _contract, "bmm": _contract, "matmul": _contract,
          "addmm": lambda n, out, sh: _contract(n, out, sh, 1), "baddbmm": lambda n, out, sh: _contract(n, out, sh, 1),
          "scaled_dot_product_attention": _attention, "conv1d": _conv}


@dataclass(frozen=True)
class Rates:
    """What the target does per second: matmul FLOPs, and bytes through memory."""
    flops: float
    bytes: float


@dataclass(frozen=True)
class LayerCosts:
    """Predicted forward seconds of each repeated layer, of what runs before them and after them."""
    layers: tuple[float, ...]
    before: float
    after: float

    def stage_seconds(self, counts: list[int]) -> list[float]:
        out, start = [], 0
        for s, c in enumerate(counts):
            out.append(sum(self.layers[start:start + c]) + (self.before if s == 0 else 0.0)
                       + (self.after if s == len(counts) - 1 else 0.0))
            start += c
        return out


def _weight_values(graph: fx.Graph) -> set[fx.Node]:
    """Trainable parameters (get_attr) and the nodes computed from them alone (a transpose, a cast)."""
    root = graph.owning_module
    out: set[fx.Node] = set()
    for n in graph.nodes:
        if n.op == "get_attr":
            value = root
            for part in n.target.split("."):
                value = getattr(value, part, None)
            if isinstance(value, torch.nn.Parameter) and value.requires_grad:
                out.add(n)
        elif n.op == "call_function" and n.all_input_nodes and all(a in out for a in n.all_input_nodes):
            out.add(n)
    return out


def _seconds(n: fx.Node, rates: Rates, sh: _Shapes, weights: set[fx.Node]) -> tuple[float, float, float]:
    """(forward, input-gradient, weight-gradient) seconds of one node (see the module doc)."""
    out = _val(n)
    if n.op != "call_function" or not isinstance(out, torch.Tensor):
        return 0.0, 0.0, 0.0
    shape = sh.of(out)
    flops = _FLOPS.get(op_name(n.target))
    f = flops(n, shape, sh) / rates.flops if flops is not None else prod(shape) * out.element_size() / rates.bytes
    if n in weights:
        return f, 0.0, 0.0            # a weight's cast or transpose: its backward is on the way to .grad
    if any(a in weights for a in n.all_input_nodes):
        return f, f, f
    return f, 2 * f, 0.0


def phase_costs(graph: fx.Graph, rates: Rates) -> tuple[LayerCosts, LayerCosts, LayerCosts]:
    """Every node priced (forward, B, W) and counted for its layer, or for before / after the layers."""
    stack = find_layers(graph)
    first = next((n for n in graph.nodes if n.op == "placeholder" and isinstance(_val(n), torch.Tensor)), None)
    sh = _Shapes(max(1, prod(_Shapes(1).of(first))) if first is not None else 1)     # the example's tokens
    weights = _weight_values(graph)
    layers = [[0.0] * stack.count for _ in range(3)]
    before, after = [0.0] * 3, [0.0] * 3
    seen_layer = False
    for n in graph.nodes:
        i = layer_of(n, stack.path)
        cost = _seconds(n, rates, sh, weights)
        for k in range(3):
            if i is not None:
                layers[k][i] += cost[k]
            elif seen_layer:
                after[k] += cost[k]
            else:
                before[k] += cost[k]
        seen_layer = seen_layer or i is not None
    return tuple(LayerCosts(tuple(layers[k]), before[k], after[k]) for k in range(3))


def boundary_bytes(graph: fx.Graph) -> float:
    """Bytes one stage sends the next per microbatch: the values the first layer makes that later
    nodes read (the residual stream), at the example's sizes."""
    stack = find_layers(graph)
    first = next((n for n in graph.nodes if n.op == "placeholder" and isinstance(_val(n), torch.Tensor)), None)
    sh = _Shapes(max(1, prod(_Shapes(1).of(first))) if first is not None else 1)
    out = 0.0
    for n in graph.nodes:
        v = _val(n)
        if layer_of(n, stack.path) == 0 and isinstance(v, torch.Tensor) \
                and any(layer_of(u, stack.path) != 0 for u in n.users):
            out += prod(sh.of(v)) * v.element_size()
    return out


def layer_costs(graph: fx.Graph, rates: Rates) -> LayerCosts:
    """Every node's forward priced and counted for its layer, or for before / after the layers."""
    return phase_costs(graph, rates)[0]


def balanced_counts(costs: LayerCosts, n_stages: int) -> list[int]:
    """Layers per stage minimising the largest stage's cost (see the module docstring)."""
    even = layers_per_stage(len(costs.layers), n_stages)
    if n_stages == 1:
        return even
    best = _min_max_cut(costs, n_stages)
    if max(costs.stage_seconds(best)) < (1 - _MARGIN) * max(costs.stage_seconds(even)):
        return best
    return even


def _min_max_cut(costs: LayerCosts, n_stages: int) -> list[int]:
    n = len(costs.layers)
    prefix = [0.0]
    for c in costs.layers:
        prefix.append(prefix[-1] + c)

    def stage(s: int, i: int, j: int) -> float:       # layers i..j-1 as stage s
        return prefix[j] - prefix[i] + (costs.before if s == 0 else 0.0) + (costs.after if s == n_stages - 1 else 0.0)

    # best[s][j]: the least largest cost of stages 0..s holding layers 0..j-1, and its cut
    best: list[dict[int, tuple[float, list[int]]]] = [{j: (stage(0, 0, j), [j]) for j in range(1, n - n_stages + 2)}]
    for s in range(1, n_stages):
        row = {}
        for j in range(s + 1, n - (n_stages - 1 - s) + 1):
            row[j] = min(((max(best[s - 1][i][0], stage(s, i, j)), best[s - 1][i][1] + [j - i])
                          for i in range(s, j) if i in best[s - 1]), key=lambda t: t[0])
        best.append(row)
    return best[-1][n][1]
