"""Recompute: outline regions of a rank graph into checkpointed submodules (Korthikanti et al. 2022).

    regions = outline_recompute(graph, "full", captured_of)     # graph edited in place

A region is a set of nodes that runs again inside backward instead of keeping what it saves:

- full: each repeated layer (passes/stages.py's `find_layers`), which then keeps only its inputs
  (the layer's input activation, parameters, masks and rotary tables the model computed outside);
- selective: the attention core of each layer, the part whose saved values grow as s^2: a product of
  two activations with a square result (q k^T), the nodes after it whose values keep that shape
  (scale, mask, softmax, dropout and its mask), and the first ops reading them (the product with
  v); or a `scaled_dot_product_attention` call (what it saves depends on the kernel: the math kernel
  that runs dropout keeps the s x s probabilities and mask; flash kernels keep only a log-sum-exp).

Each region becomes one `call_module` node `recompute_<layer path>` (`recompute_attention_...` for
selective) whose module (autoshard/regions/recompute.py) runs the region's graph under
torch.utils.checkpoint; the rank code shows the call, and `module.body.code` the recomputed nodes.
Parameters and buffers stay outside (`get_attr` nodes), so they are read as inputs. A region is
closed under "between": a node with an ancestor and a descendant in the region joins it (the f / g
collectives the rewrite inserted carry no module path). Outputs of the region keep their node names
(as getitem nodes), so stage splitting and printing see the same names as before.
"""
from __future__ import annotations

import operator
import re
from dataclasses import dataclass
from typing import Callable

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from autoshard.errors import ShardingError
from autoshard.passes.graph_reading import module_path, op_name
from autoshard.passes.outline import between, outline, stable_toposort
from autoshard.passes.stages import find_layers, layer_of

__all__ = ["RECOMPUTE_MODES", "RecomputeRegion", "outline_recompute"]

RECOMPUTE_MODES = ("none", "selective", "full")
_PRODUCTS = ("bmm", "matmul", "baddbmm", "einsum")
_SDPA = ("scaled_dot_product_attention", "_scaled_dot_product_flash_attention_for_cpu",
         "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention")


@dataclass
class RecomputeRegion:
    """One outlined region: the module name its call uses, its graph (inputs in call order, a tuple
    out), the layer it belongs to and the mode that chose it."""
    name: str
    graph: fx.Graph
    layer: str
    mode: str


def _trailing(val: object) -> tuple | None:
    """The last two dims of a value (of a tuple's first tensor: native_dropout's output and mask)."""
    if isinstance(val, (tuple, list)) and val:
        val = val[0]
    return tuple(val.shape[-2:]) if isinstance(val, torch.Tensor) and val.dim() >= 3 else None


def _square(dims: tuple | None) -> bool:
    return dims is not None and _same(dims[0], dims[1]) and not _same(dims[0], 1)


def _attention_core(nodes: list[fx.Node], captured_of: Callable[[fx.Node], fx.Node | None],
                    activation: set[fx.Node]) -> set[fx.Node]:
    """The s^2 part of one layer's attention (see the module docstring): each SDPA call, and each
    product of two activations with a square result (q k^T) with what follows it while values keep
    that shape (scale, mask, softmax, dropout), and the first readers of those (the product with v)."""
    in_layer = set(nodes)
    core: set[fx.Node] = set()
    for n in nodes:
        src = captured_of(n)
        if src is None or n in core:
            continue
        name = op_name(src.target) if src.op == "call_function" else ""
        if name in _SDPA:
            core.add(n)
            continue
        scores = _trailing(src.meta.get("val"))
        if name not in _PRODUCTS or not _square(scores) or \
                sum(isinstance(a, fx.Node) and a in activation for a in n.args) < 2:
            continue
        todo = [n]
        while todo:
            m = todo.pop()
            if m in core:
                continue
            core.add(m)
            for u in m.users:
                if u not in in_layer or u.op == "output":
                    continue
                usrc = captured_of(u)
                dims = _trailing(usrc.meta.get("val")) if usrc is not None else None
                if dims is not None and all(_same(a, b) for a, b in zip(dims, scores)) or u.target is operator.getitem:
                    todo.append(u)          # still a scores-shaped value: walk on
                else:
                    core.add(u)             # a reader (the product with v): included, not walked past
    return core


def _same(a, b) -> bool:
    """Equal for every size the graph was exported for, decided without a guard: `bool(a == b)` on
    symbolic sizes would add one to the export's shape environment and could specialize a size to
    the example's (the captured graph's shapes would then read differently to the next rank's call)."""
    try:
        return bool(statically_known_true(a == b))
    except Exception:           # an undecidable symbolic comparison: not the same
        return False


def _activations(graph: fx.Graph) -> set[fx.Node]:
    """Nodes that depend on a step input other than through shapes: not parameters, buffers or
    values computed from them alone (masks built from a buffer are kept, not recomputed)."""
    act: set[fx.Node] = set()
    for n in graph.nodes:
        if n.op == "placeholder":
            val = n.meta.get("val")
            if val is None or isinstance(val, torch.Tensor):
                act.add(n)
        elif n.op != "get_attr" and any(a in act for a in n.all_input_nodes):
            act.add(n)
    return act


def outline_recompute(graph: fx.Graph, mode: str, captured_of: Callable[[fx.Node], fx.Node | None],
                      suffix: str = "") -> list[RecomputeRegion]:
    """Outline `mode`'s regions of `graph` (one rank's graph, after fusion) in place; returns them.
    `captured_of(node)` gives the captured (single-device) node a rank node was rewritten from, or
    None; selective reads the op and shapes there."""
    if mode not in RECOMPUTE_MODES:
        raise ShardingError(f"recompute must be one of {', '.join(RECOMPUTE_MODES)}, got {mode!r}")
    if mode == "none":
        return []
    stack = find_layers(graph)
    by_layer: dict[int, list[fx.Node]] = {}
    for n in graph.nodes:
        if n.op not in ("placeholder", "get_attr", "output"):
            i = layer_of(n, stack.path)
            if i is not None:
                by_layer.setdefault(i, []).append(n)
    activation = _activations(graph) if mode == "selective" else set()
    plans: list[tuple[int, set[fx.Node]]] = []
    for i in sorted(by_layer):
        seeds = set(by_layer[i]) if mode == "full" else _attention_core(by_layer[i], captured_of, activation)
        seeds = {n for n in seeds if not _size_arithmetic(n, captured_of)}
        if seeds:
            region = {n for n in between(graph, seeds)
                      if n.op not in ("placeholder", "get_attr") and not _size_arithmetic(n, captured_of)}
            plans.append((i, region))
    for i, region in plans:
        others = [n for n in region if layer_of(n, stack.path) not in (None, i)]
        if others:
            n = others[0]
            raise ShardingError(f"recompute={mode!r}: layer {i} of {stack.path} reaches node {n.name} of "
                                f"{module_path(n)} and back; its layers do not run one after another")
    regions = []
    for i, region in plans:
        prefix = "recompute_attention_" if mode == "selective" else "recompute_"
        name = prefix + re.sub(r"\W", "_", f"{stack.path}.{i}") + suffix
        regions.append(_outline(graph, region, name, f"{stack.path}.{i}", mode))
    stable_toposort(graph, "recompute")
    graph.lint()
    return regions


def _size_arithmetic(n: fx.Node, captured_of: Callable[[fx.Node], fx.Node | None]) -> bool:
    """A node computing a size (a SymInt from the inputs' sizes: 2 * batch * seq): it stays outside
    regions, where the stage split recomputes it on every stage (a region's output would be sent)."""
    src = captured_of(n)
    val = n.meta.get("val", src.meta.get("val") if src is not None else None)
    return isinstance(val, (int, torch.SymInt)) and not isinstance(val, bool)


def _outline(graph: fx.Graph, region: set[fx.Node], name: str, layer: str, mode: str) -> RecomputeRegion:
    ordered = [n for n in graph.nodes if n in region]
    meta = {"nn_module_stack": _layer_stack(ordered, layer), "recompute": mode}
    _, body = outline(graph, region, name, after=ordered[-1], meta=meta)
    return RecomputeRegion(name, body, layer, mode)


def _layer_stack(nodes: list[fx.Node], layer: str) -> dict:
    """The module stack down to the layer itself, from a node of the region."""
    for n in nodes:
        stack = n.meta.get("nn_module_stack") or {}
        items = list(stack.items())
        for k, (key, (path, _)) in enumerate(items):
            if path == layer:
                return dict(items[: k + 1])
    return {}
