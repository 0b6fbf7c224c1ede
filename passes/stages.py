"""Partition: one rank's graph -> pipeline stages (Narayanan et al. 2021, section 2.2).

The repeated layers are found from the captured module hierarchy (`nn_module_stack`): the outermost
`ModuleList` whose children own graph nodes (`transformer.h.3`, `model.layers.3`). Every node is
then one of three kinds:

- INPUT: computed from the step's inputs and buffers alone (attention masks, position ids, rotary
  cos/sin tables). Such nodes are recomputed in every stage that reads them; nothing is sent.
- PARAM: a parameter read. Copied into every stage that uses the parameter (a tied embedding is
  read by the first and the last stage; its gradients are summed between them at run time).
- ACT: everything else. A node inside layer i runs in layer i's stage; a node outside the layers
  runs as early as its inputs allow if it reads an activation (final norm, head, loss: last stage),
  else as late as its users allow (embedding: first stage).

A value made in stage s and read in stage t > s is an output of stages s .. t-1 and an input of
stages s+1 .. t: values only travel between neighbouring stages, as point-to-point sends do.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

import torch.fx as fx

from autoshard.errors import ShardingError
from autoshard.passes.graph_reading import module_path
from autoshard.passes.tables import TABLES

__all__ = ["LayerStack", "StageGraph", "counts_from_cuts", "find_layers", "layer_of", "layers_per_stage", "split_stages"]

_INPUT, _PARAM, _ACT = "input", "param", "act"


@dataclass(frozen=True)
class LayerStack:
    """The repeated layers: module path of the list and the number of layers in it."""
    path: str
    count: int


@dataclass
class StageGraph:
    """One pipeline stage: its graph, the values it receives (after the model's own inputs, in this
    order) and the values it sends on (the last stage returns the model's outputs instead)."""
    index: int
    graph: fx.Graph
    receives: list[str]
    sends: list[str]
    layers: range


def _stack_paths(node: fx.Node) -> list[str]:
    return [path for path, _ in (node.meta.get("nn_module_stack") or {}).values()]


def find_layers(graph: fx.Graph) -> LayerStack:
    """The outermost module list with the most children that own nodes."""
    found: dict[str, set[int]] = {}
    for n in graph.nodes:
        for path in _stack_paths(n):
            m = re.fullmatch(r"(.+)\.(\d+)", path)
            if m:
                found.setdefault(m.group(1), set()).add(int(m.group(2)))
    if not found:
        raise ShardingError("pipeline parallelism found no repeated layers (no module list such as "
                            "`model.layers` owns any graph node); pp must be 1 for this model")
    path = min(found, key=lambda p: (p.count("."), -len(found[p])))
    count = max(found[path]) + 1
    if sorted(found[path]) != list(range(count)):
        raise ShardingError(f"layers of {path} own nodes only for indices {sorted(found[path])}; "
                            f"cannot cut the model into pipeline stages by layer")
    return LayerStack(path, count)


def layers_per_stage(n_layers: int, n_stages: int) -> list[int]:
    """Layer counts per stage, as even as possible. With a remainder, the extra layers go to the
    middle stages first (the first stage also runs the embedding, the last the head and the loss),
    then to the first, then to the last."""
    if n_stages > n_layers:
        raise ShardingError(f"{n_stages} pipeline stages (pp x virtual chunks) need at least {n_stages} "
                            f"layers, the model has {n_layers}")
    counts = [n_layers // n_stages] * n_stages
    order = list(range(1, n_stages - 1)) + [0, n_stages - 1] if n_stages > 1 else [0]
    for s in order[: n_layers % n_stages]:
        counts[s] += 1
    return counts


def counts_from_cuts(cuts: list[int], n_layers: int, n_stages: int) -> list[int]:
    """Layers per stage from the first layer of each stage after the first ([3, 6] of 8 layers ->
    [3, 3, 2]); a cut that does not give every stage at least one layer is refused, naming it."""
    if len(cuts) != n_stages - 1 or any(not isinstance(c, int) or isinstance(c, bool) for c in cuts):
        raise ShardingError(f"stage_cuts={cuts}: {n_stages} stages need {n_stages - 1} cut(s), each the "
                            f"first layer (an int) of a stage after the first")
    bounds = [0, *cuts, n_layers]
    if any(b <= a for a, b in zip(bounds, bounds[1:])):
        raise ShardingError(f"stage_cuts={cuts}: the cuts must rise strictly within 1..{n_layers - 1} "
                            f"(the model has {n_layers} layers), so that every stage holds a layer")
    return [b - a for a, b in zip(bounds, bounds[1:])]


def layer_of(node: fx.Node, prefix: str) -> int | None:
    for path in _stack_paths(node):
        m = re.match(re.escape(prefix) + r"\.(\d+)(\.|$)", path)
        if m:
            return int(m.group(1))
    return None


def _kinds(graph: fx.Graph, param_names: dict[str, str]) -> dict[fx.Node, str]:
    kinds: dict[fx.Node, str] = {}
    for n in graph.nodes:
        if n.op == "placeholder":
            kinds[n] = _INPUT
        elif n.op == "get_attr":
            kinds[n] = _PARAM if n.target in param_names else _INPUT
        elif (n.op == "call_function" or n.meta.get(TABLES)) and all(kinds[a] == _INPUT for a in n.all_input_nodes):
            kinds[n] = _INPUT          # collectives and random ops are modules: never recomputed; the
            # cached tables (passes/tables.py) are a module that each stage calls, computed once
        elif n.op != "output":
            kinds[n] = _ACT
    return kinds


def _assign_stages(graph: fx.Graph, kinds: dict[fx.Node, str], layer_stage: list[int], prefix: str,
                   last: int, late: Callable[[fx.Node], bool]) -> dict[fx.Node, int]:
    """Stage of every ACT node."""
    stage: dict[fx.Node, int] = {}
    for n in graph.nodes:       # forward: layer nodes, and nodes reading activations of known stage
        if kinds.get(n) != _ACT or (late(n) and layer_of(n, prefix) is None):
            continue
        layer = layer_of(n, prefix)
        after = [stage[a] for a in n.all_input_nodes if a in stage]
        if layer is not None:
            stage[n] = layer_stage[layer]
            if after and max(after) > stage[n]:
                raise ShardingError(f"node {n.name} in {module_path(n)} (layer {layer}, stage {stage[n]}) "
                                    f"reads a value of stage {max(after)}; layers must run in order")
        elif after:
            stage[n] = max(after)
    for n in reversed(graph.nodes):    # backward: pre-layer nodes run where they are first needed
        if kinds.get(n) == _ACT and n not in stage and n.users:
            users = [last if u.op == "output" else stage.get(u) for u in n.users]
            known = [s for s in users if s is not None]
            stage[n] = min(known) if known else last
    for n in graph.nodes:       # nodes nobody reads (metadata asserts) run with their inputs
        if kinds.get(n) == _ACT and n not in stage:
            stage[n] = max([stage[a] for a in n.all_input_nodes if a in stage], default=0)
    return stage


def split_stages(gm: fx.GraphModule | fx.Graph, n_stages: int, param_names: dict[str, str] | set[str],
                 late: Callable[[fx.Node], bool] = lambda n: False, counts: list[int] | None = None) -> list[StageGraph]:
    """Cut `gm` (one rank's graph, or its module) into `n_stages` stage graphs; see the module docstring. Nodes
    outside the layers for which `late(node)` holds run where their users run, not where their
    inputs are made: an identity-forward collective (Megatron's f) between a norm in one stage and a
    matmul in the next would otherwise send the same values twice. `counts`: the layers of each
    stage (default: layers_per_stage's even counts)."""
    graph = gm.graph if isinstance(gm, fx.GraphModule) else gm
    kinds = _kinds(graph, param_names)
    if n_stages == 1:       # one stage: the whole graph, whatever the model's structure
        counts = [0]
        stage = {n: 0 for n, k in kinds.items() if k == _ACT}
    else:
        stack = find_layers(graph)
        if counts is None:
            counts = layers_per_stage(stack.count, n_stages)
        elif len(counts) != n_stages or sum(counts) != stack.count or min(counts) < 1:
            raise ShardingError(f"stage layer counts {counts} do not cut {stack.count} layers into {n_stages} "
                                f"stages of at least one layer")
        layer_stage = [s for s, c in enumerate(counts) for _ in range(c)]
        stage = _assign_stages(graph, kinds, layer_stage, stack.path, n_stages - 1, late)
    output = next(n for n in graph.nodes if n.op == "output")
    readers: dict[fx.Node, int] = {}      # last stage that reads each ACT value
    for n in graph.nodes:
        at = n_stages - 1 if n.op == "output" else stage.get(n)
        if at is None:
            continue
        for a in n.all_input_nodes:
            if a in stage:
                readers[a] = max(readers.get(a, at), at)
    carried = [[v for v in graph.nodes if v in stage and stage[v] < s <= readers.get(v, -1)]
               for s in range(n_stages)]        # carried[s]: values stage s receives
    starts = [sum(counts[:s]) for s in range(n_stages)]
    stages = []
    for s in range(n_stages):
        sends = carried[s + 1] if s + 1 < n_stages else []
        g = _stage_graph(graph, kinds, stage, s, carried[s], sends, output if s == n_stages - 1 else None)
        stages.append(StageGraph(s, g, [v.name for v in carried[s]], [v.name for v in sends],
                                 range(starts[s], starts[s] + counts[s])))
    return stages


def _stage_graph(graph: fx.Graph, kinds: dict[fx.Node, str], stage: dict[fx.Node, int], s: int,
                 receives: list[fx.Node], sends: list[fx.Node], output: fx.Node | None) -> fx.Graph:
    roots = [n for n in graph.nodes if stage.get(n) == s] + sends
    if output is not None:
        roots += output.all_input_nodes
    needed: set[fx.Node] = set()
    todo = list(roots)
    while todo:        # this stage's nodes, and the INPUT and PARAM nodes they read (recomputed here)
        n = todo.pop()
        if n in needed or n in receives:
            continue
        needed.add(n)
        todo += [a for a in n.all_input_nodes if kinds.get(a) != _ACT or stage.get(a) == s]
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in graph.nodes:
        if n.op == "placeholder":       # every stage takes the step's inputs, used or not
            env[n] = g.node_copy(n)
    for v in receives:
        env[v] = g.placeholder(v.name)
        env[v].meta = dict(v.meta)
    for n in graph.nodes:
        if n in needed and n not in env and n.op != "output":
            env[n] = g.node_copy(n, lambda a: env[a])
    if output is not None:
        g.output(fx.map_arg(output.args[0], lambda a: env[a]))
    else:
        g.output(tuple(env[v] for v in sends))
    g.lint()
    return g
