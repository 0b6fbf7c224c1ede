"""Expert parallelism: each mixture-of-experts experts call of a rank graph outlined into one module.

    regions = outline_experts(graph, {"model.layers.0.mlp.experts": 8, ...}, value_of, param_names)

Hugging Face's MoE decoders (transformers 5) route through one experts module per layer with a
fixed contract: `experts(hidden [n, H], top_k_index [n, k], top_k_weights [n, k]) -> [n, H]`, the
experts' weights stacked on a leading experts dim. The nodes the export made of that call (every
node whose module stack holds the module's path, and the f / g between them) become one
`call_module` node `experts_<path>` whose module (autoshard/regions/experts_call.py) runs the region's
graph as it is when no expert-parallel group is bound (one process; expert parallelism of 1), and
otherwise sends the (token, slot) pairs to the ranks that own their experts
(autoshard/parallel/expert_parallel.py). The parameters stay outside as inputs, so each rank reads
only its own experts' slices once the runtime cuts them.

A call the pass cannot read this way is refused, naming the module and why: more than one value
leaving it, inputs that are not one hidden-states, one integer index and one weights tensor,
parameters without the experts dim first, or a count of experts the expert-parallel size does not
divide.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

import torch
import torch.fx as fx

from autoshard.errors import ShardingError
from autoshard.passes.outline import between, outline, stable_toposort

__all__ = ["ExpertRegion", "outline_experts", "TP_SYNC"]

TP_SYNC = ("f", "g")        # the rank modules a tensor-parallel experts region may call


@dataclass
class ExpertRegion:
    """One outlined experts call: its module name and graph, the model's module path and count of
    experts, the positions of its inputs in the call (hidden, index, weights; parameter -> position)
    and whether its experts are split over tensor-parallel ranks too (the region calls f and g)."""
    name: str
    graph: fx.Graph
    path: str
    experts: int
    hidden: int
    index: int | None          # None: the experts read every expert's copy of the tokens (no routing inputs)
    weights: int | None
    params: dict[str, int]
    tensor_parallel: bool
    # parameters the region adds after its g (a row-parallel bias: gpt-oss's down_proj_bias): the
    # model's own experts module, run per tp rank when bound, adds them to each rank's partial sum
    after_reduce: tuple[str, ...] = ()
    # every expert's copies returned as [experts, n, H]: the export folded the module's closing
    # view(-1, H) into the reshape after it (Llama 4's sum over the copies)
    stacked_out: bool = False
    # the region calls g itself; where the export put g after the sum over Llama 4's copies, the
    # call returns partial sums and the rank graph's own g reduces them
    reduced: bool = True


def _paths(node: fx.Node) -> set[str]:
    return {path for path, _ in (node.meta.get("nn_module_stack") or {}).values()}


def outline_experts(graph: fx.Graph, experts: dict[str, int], value_of: Callable[[fx.Node], object],
                    param_names: dict[str, str], ep: int, suffix: str = "") -> list[ExpertRegion]:
    """Outline every experts call of `graph` (module path -> number of experts); see the module
    docstring. `param_names`: get_attr target -> the model's parameter name."""
    regions = []
    for path, count in experts.items():
        seeds = {n for n in graph.nodes if n.op == "call_function" and path in _paths(n)
                 and not isinstance(value_of(n), (int, torch.SymInt))}      # size arithmetic stays shared
        if not seeds:
            continue
        if count % ep:
            raise ShardingError(f"{path}: {count} experts cannot be divided over ep={ep} ranks; "
                                f"choose an ep that divides {count}")
        region = {n for n in between(graph, seeds) if n.op not in ("placeholder", "get_attr")}
        others = sorted(str(n.target) for n in region if n.op == "call_module" and n.target not in TP_SYNC)
        if others:
            raise ShardingError(f"{path}: expert parallelism cannot outline a region that calls {others} "
                                "(only tensor parallelism's f and g)")
        ordered = [n for n in graph.nodes if n in region]
        name = "experts_" + re.sub(r"\W", "_", path) + suffix
        call, body = outline(graph, region, name, after=ordered[-1], meta={"experts": path})
        stable_toposort(graph, "expert parallelism")
        regions.append(_read_region(name, body, call, path, count, value_of, param_names))
    return regions


def _after_reduce(body: fx.Graph, params: dict[str, int]) -> tuple[str, ...]:
    """The parameters of a tensor-parallel region none of whose uses reaches its g: added to the
    reduced sum, so counted once (regions/experts_call.py runs them on one tp rank)."""
    reaches_g = {n for n in body.nodes if n.op == "call_module" and n.target == "g"}
    if not reaches_g:
        return ()
    for n in reversed(body.nodes):
        if any(u in reaches_g for u in n.users):
            reaches_g.add(n)
    inputs = [n for n in body.nodes if n.op == "placeholder"]
    return tuple(name for name, i in params.items() if inputs[i] not in reaches_g)


def _read_region(name: str, body: fx.Graph, call: fx.Node, path: str, count: int,
                 value_of: Callable[[fx.Node], object], param_names: dict[str, str]) -> ExpertRegion:
    outs = next(n for n in body.nodes if n.op == "output").args[0]
    if len(outs) != 1:
        raise ShardingError(f"{path}: {len(outs)} values leave the experts call ({[str(o) for o in outs]}); "
                            "expert parallelism needs exactly one (the [tokens, hidden] output)")
    params: dict[str, int] = {}
    tensors: list[tuple[int, torch.Tensor]] = []
    for i, a in enumerate(call.args):
        if a.op == "get_attr" and a.target in param_names:
            params[param_names[a.target]] = i
            continue
        val = value_of(a)
        if isinstance(val, torch.Tensor):
            tensors.append((i, val))
    bad = {p: tuple(value_of(call.args[i]).shape) for p, i in params.items()
           if value_of(call.args[i]).shape[:1] != (count,)}
    if not params or bad:
        raise ShardingError(f"{path}: expert parallelism cuts parameters on a leading experts dim of {count}; "
                            f"{bad or 'the call reads no parameter'}")
    index = [i for i, v in tensors if not v.is_floating_point()]
    floats = [(i, v) for i, v in tensors if v.is_floating_point()]
    shapes = {i: tuple(v.shape) for i, v in tensors}
    tensor_parallel = any(n.op == "call_module" for n in body.nodes)
    if not index and len(floats) == 1 and len(shapes[floats[0][0]]) == 2:
        # every expert's copy of the tokens, expert-major (Llama 4): [experts * n, H]
        out = value_of(next(iter(call.users)))            # the getitem of the call's one output
        stacked = isinstance(out, torch.Tensor) and out.dim() == 3 and out.shape[0] == count
        reduced = any(n.op == "call_module" and n.target == "g" for n in body.nodes)
        return ExpertRegion(name, body, path, count, floats[0][0], None, None, params, tensor_parallel,
                            _after_reduce(body, params), stacked, reduced)
    if len(index) == 1 and len(floats) == 2:
        k_shape = shapes[index[0]]
        weights = [i for i, v in floats if tuple(v.shape) == k_shape]
        hidden = [i for i, v in floats if tuple(v.shape) != k_shape]
        if len(weights) == 1 and len(hidden) == 1 and len(shapes[hidden[0]]) == 2 and len(k_shape) == 2:
            return ExpertRegion(name, body, path, count, hidden[0], index[0], weights[0], params,
                                tensor_parallel, _after_reduce(body, params))
    raise ShardingError(f"{path}: expert parallelism expects the experts call to read hidden states [n, H], "
                        f"top-k indices [n, k] and top-k weights [n, k], or every expert's copy of the "
                        f"tokens [experts * n, H] alone; its tensor inputs are "
                        f"{[(str(call.args[i]), shapes[i], str(v.dtype)) for i, v in tensors]}")
