"""Rewrite: the annotated graph -> rank r's graph. Reads `node.meta["sharding"]`, changes nothing else.

Every rank's graph has the same nodes in the same order (only literals differ), which is what lets
the simulator run all ranks in lockstep. The collectives appear as calls to the rank's modules
`f`, `g` and `sync_<param>`, so printed code reads like Megatron's layers.

A node is copied with its edits applied: each edit kind is a row of edits.py's `EDITS`; the state
they share (the new graph, the f of each value, the modules emitted) is rank_state.py's `RankRewrite`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx as fx

from autoshard.errors import ShardingError
from autoshard.parallel.random_ops import RANDOM_OPS, draws_randomly
from autoshard.parallel.registry import ModuleSpec
from autoshard.parallel.rng import RandomOpSpec
from autoshard.passes.graph_reading import op_name
from autoshard.passes.rewrite.edits import ARGS, EDITS, REPLACE, NodeCall
from autoshard.passes.rewrite.rank_state import RankRewrite, sharded_out
from autoshard.passes.sharding.annotate import ShardingPlan
from autoshard.passes.sharding.placement import NodeSharding

__all__ = ["RankGraph", "rewrite_rank"]

aten = torch.ops.aten


@dataclass
class RankGraph:
    graph: fx.Graph
    modules: list[ModuleSpec]
    restrict_buffers: dict[str, torch.Tensor]
    regions: list = field(default_factory=list)     # passes/recompute.py's RecomputeRegion, once outlined
    tables: object = None                           # passes/tables.py's TableRegion, once outlined
    experts: list = field(default_factory=list)     # passes/outline_experts.py's ExpertRegion, once outlined
    context: object = None                          # passes/context/split.py's ContextCut (cp > 1)


def _edited(rw: RankRewrite, node: fx.Node, ns: NodeSharding) -> fx.Node:
    """The node with its edits applied (EDITS), emitted into the rank graph."""
    read = rw.read_entering if sharded_out(ns) else rw.env.__getitem__
    call = NodeCall(node, ns, list(fx.map_arg(node.args, read)), dict(fx.map_arg(node.kwargs, read)))
    rows = []
    for e in ns.edits:
        if type(e) not in EDITS:
            raise ShardingError(f"node {node.name}: the analysis wrote an edit {type(e).__name__} that "
                                f"passes/rewrite/edits.py's EDITS has no row for")
        rows.append((e, EDITS[type(e)]))
    for phase in (ARGS, REPLACE):
        for e, row in rows:
            if row.phase == phase and row.apply is not None and call.replaced is None:
                row.apply(rw, call, e)
    if call.replaced is not None:
        return call.replaced
    new = _emit(rw, call)
    for e, row in rows:
        if row.after is not None:
            new = row.after(rw, call, e, new)
    return new


def _emit(rw: RankRewrite, call: NodeCall) -> fx.Node:
    node, args, target = call.node, call.args, call.node.target
    if call.row is not None and call.row.bias_arg is not None and len(args) > call.row.bias_arg:
        call.bias = args[call.row.bias_arg]
        if target == aten.addmm.default:        # addmm(b, x, W) -> mm(x, W) + b
            target, args = aten.mm.default, args[1:3]
        else:
            args = args[:call.row.bias_arg]
    if node.op == "call_function" and draws_randomly(op := op_name(target), tuple(args), call.kwargs):
        region, prefix = ("tensor_parallel", "tp") if sharded_out(call.ns) else ("replicated", "replicated")
        spec = RandomOpSpec(f"{prefix}_rng_{node.name}{rw.suffix}", target, region, RANDOM_OPS[op])
        rw.modules.append(spec)
        new = rw.g.create_node("call_module", spec.module, tuple(args), call.kwargs, name=node.name)
    else:
        new = rw.g.create_node(node.op, target, tuple(args), call.kwargs, name=node.name)
    new.meta = {k: v for k, v in node.meta.items() if k in ("nn_module_stack", "stack_trace")}
    new.meta["captured"] = node.name          # the captured node it comes from (its shapes are there)
    return new


def rewrite_rank(gm: fx.GraphModule, plan: ShardingPlan, param_names: dict[str, str], r: int,
                 suffix: str = "") -> RankGraph:
    """Rank r's graph. `suffix` names this graph's own modules and buffers apart from those of the
    rank's other graphs (other input signatures: their layouts may differ)."""
    rw = RankRewrite(gm, plan, param_names, r, suffix)
    for node in gm.graph.nodes:
        ns: NodeSharding = node.meta.get("sharding", NodeSharding())
        if node.op == "get_attr" and node.target in param_names:
            rw.env[node] = rw.param(node)
        elif node.op == "output":
            rw.env[node] = rw.g.output(fx.map_arg(node.args[0], lambda n: rw.gather_out(n, ns)))
        else:
            # Megatron's rule: every replicated value entering a sharded region goes through f, so
            # that its gradient (each rank holds only its own part of it) is summed over the group.
            rw.env[node] = _edited(rw, node, ns)
    rw.g.lint()
    return RankGraph(rw.g, rw.modules, rw.buffers)
