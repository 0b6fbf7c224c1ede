"""Rewrite: the annotated graph -> rank r's graph. Reads `node.meta["sharding"]`, changes nothing else.

Every rank's graph has the same nodes in the same order (only literals differ), which is what lets
the simulator run all ranks in lockstep. The collectives appear as calls to the rank's modules
`f`, `g` and `sync_<param>`, so printed code reads like Megatron's layers.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx as fx

from autoshard.bounds import check_token_ids
from autoshard.parallel.random_ops import RANDOM_OPS, draws_randomly
from autoshard.parallel.registry import ModuleSpec
from autoshard.parallel.rng import RandomOpSpec
from autoshard.parallel.sequence_parallel import SequenceSpec
from autoshard.parallel.tensor_parallel import SyncSpec
from autoshard.parallel.vocab_parallel import CrossEntropySpec, GatherSpec
from autoshard.passes.graph_reading import op_name, param_read
from autoshard.passes.rewrite.grad_flow import grad_flow
from autoshard.passes.sharding.annotate import ShardingPlan
from autoshard.passes.sharding.index_sets import is_even_chunks, is_partition
from autoshard.passes.sharding.placement import (
    ArgEdit,
    ColumnInput,
    GatherOutputs,
    GatherTokens,
    NodeSharding,
    ParamUse,
    Restrict,
    RowParallel,
    SequenceScatter,
    Shard,
    VocabCrossEntropy,
    VocabLookup,
)

__all__ = ["RankGraph", "rewrite_rank"]

aten = torch.ops.aten


@dataclass
class RankGraph:
    graph: fx.Graph
    modules: list[ModuleSpec]
    restrict_buffers: dict[str, torch.Tensor]
    regions: list = field(default_factory=list)     # passes/recompute.py's RecomputeRegion, once outlined
    tables: object = None                           # passes/tables.py's TableRegion, once outlined
    experts: list = field(default_factory=list)     # passes/experts.py's ExpertRegion, once outlined


def _set(container, edit_item, value):
    if edit_item is None:
        return value
    seq = list(container)
    seq[edit_item] = value
    return seq


def _sync_name(param: str) -> str:
    return "sync_" + param.replace(".", "_")


def _sharded_out(ns: NodeSharding) -> bool:
    outs = ns.placement if isinstance(ns.placement, tuple) else (ns.placement,)
    return any(isinstance(p, Shard) for p in outs)


def _replicated(n: fx.Node) -> bool:
    ns = n.meta.get("sharding")
    return ns is None or not _sharded_out(ns)


def rewrite_rank(gm: fx.GraphModule, plan: ShardingPlan, param_names: dict[str, str], r: int,
                 suffix: str = "") -> RankGraph:
    """Rank r's graph. `suffix` names this graph's own modules and buffers apart from those of the
    rank's other graphs (other input signatures: their layouts may differ)."""
    g = fx.Graph()
    needs_grad = grad_flow(gm)
    env: dict[fx.Node, fx.Node] = {}
    f_of: dict[fx.Node, fx.Node] = {}
    modules: list[ModuleSpec] = []
    gathered: dict[fx.Node, fx.Node] = {}
    tokens_of: dict[fx.Node, fx.Node] = {}
    buffers: dict[str, torch.Tensor] = {}

    def read_entering(n: fx.Node) -> fx.Node:
        """An input of a node whose output is sharded: replicated values come in through f."""
        read_param = param_read(n, param_names)
        local_shard = read_param is not None and read_param[0] in plan.params
        if _replicated(n) and needs_grad(n) and not local_shard:
            if n not in f_of:
                f_of[n] = g.call_module("f", (env[n],))
            return f_of[n]
        return env[n]

    def seq_collective(kind: str, name: str, dim: int, outer: int, x: fx.Node) -> fx.Node:
        spec = SequenceSpec(f"{name}{suffix}", kind, dim, outer)
        modules.append(spec)
        return g.call_module(spec.module, (x,))

    def gather_out(n: fx.Node, ns: NodeSharding) -> fx.Node:
        """A value the model returns: gathered to full size if sharded (unless asked not to)."""
        p = n.meta["sharding"].placement
        want = any(isinstance(e, GatherOutputs) and e.gather for e in ns.edits)
        if not isinstance(p, Shard) or not want:
            return env[n]
        if n not in gathered:
            spec = GatherSpec(f"gather_{n.name}{suffix}", p.dim, p.size, int(n.meta["val"].shape[p.dim]), p.layout[r],
                              is_even_chunks(tuple(map(tuple, p.layout)), p.size))
            modules.append(spec)
            gathered[n] = g.call_module(spec.module, (env[n],))
        return gathered[n]

    def vocab_lookup(args: list, e: VocabLookup) -> tuple[list, fx.Node]:
        """Ids this rank owns, shifted to local rows; the others point at row 0 and are zeroed after."""
        start, valid = e.starts[r], e.valid[r]
        checked = g.call_function(check_token_ids, (args[1], sum(e.valid)))     # as nn.Embedding raises
        local = g.call_function(aten.sub.Tensor, (checked, start))
        outside = g.call_function(aten.__or__.Tensor, (g.call_function(aten.lt.Scalar, (local, 0)),
                                                      g.call_function(aten.ge.Scalar, (local, valid))))
        args[1] = g.call_function(aten.masked_fill.Scalar, (local, outside, 0))
        if len(args) > 2 and args[2] is not None and args[2] >= 0:
            args[2] = args[2] - start if start <= args[2] < start + valid else -1
        return args, outside

    def restrict(x: fx.Node, e: Restrict, base: str) -> fx.Node:
        keep = e.keep[r]
        if all(len(k) == 1 for k in e.keep):
            (a, b), = keep
            return g.call_function(aten.slice.Tensor, (x, e.dim, a, b))
        name = f"_keep_{base}_{e.arg}{suffix}"
        buffers[name] = torch.tensor([i for a, b in keep for i in range(a, b)])
        return g.call_function(aten.index_select.default, (x, e.dim, g.get_attr(name)))

    for node in gm.graph.nodes:
        ns: NodeSharding = node.meta.get("sharding", NodeSharding())
        if node.op == "get_attr" and node.target in param_names:
            name = param_names[node.target]
            new = g.get_attr(name)
            use = plan.params.get(name)
            size = use and (use.padded or _size_of(gm, node.target, use))
            if use is not None and not is_partition(use.layout, size):   # rows shared between ranks
                spec = SyncSpec(_sync_name(name), name, use.dim, size, use.layout[r])
                modules.append(spec)
                new = g.call_module(spec.module, (new,))
            env[node] = new
            continue
        # Megatron's rule: every replicated value entering a sharded region goes through f, so that
        # its gradient (each rank holds only its own part of it) is summed over the group.
        if node.op == "output":
            env[node] = g.output(fx.map_arg(node.args[0], lambda n: gather_out(n, ns)))
            continue
        read = read_entering if _sharded_out(ns) else env.__getitem__
        args = list(fx.map_arg(node.args, read))
        kwargs = dict(fx.map_arg(node.kwargs, read))
        row: RowParallel | None = None
        for e in ns.edits:
            if isinstance(e, ArgEdit):
                args[e.arg] = _set(args[e.arg], e.item, e.values[r])
            elif isinstance(e, Restrict):
                src = args[e.arg] if e.item is None else args[e.arg][e.item]
                args[e.arg] = _set(args[e.arg], e.item, restrict(src, e, node.name))
            elif isinstance(e, GatherTokens):
                x = node.args[e.arg]
                if x not in tokens_of:
                    kind = "all_gather" if e.reduce_grads else "all_gather_keep_grad"
                    tokens_of[x] = seq_collective(kind, f"gather_from_sequence_{x.name}", e.dim, e.outer, env[x])
                args[e.arg] = tokens_of[x]
            elif isinstance(e, ColumnInput):
                # Gathered tokens need no f: the all-gather's backward reduce-scatter sums the grads.
                # Otherwise one f per source value, shared with read_entering's memo: never f(f(x)).
                x = node.args[e.arg]
                if x in tokens_of:
                    continue
                if x not in f_of:
                    f_of[x] = g.call_module("f", (args[e.arg],))
                args[e.arg] = f_of[x]
            elif isinstance(e, RowParallel):
                row = e
        lookup_outside = None
        for e in ns.edits:
            if isinstance(e, VocabLookup):
                args, lookup_outside = vocab_lookup(args, e)
            elif isinstance(e, VocabCrossEntropy):
                red = args[3] if len(args) > 3 else kwargs.get("reduction", 1)
                ignore = args[4] if len(args) > 4 else kwargs.get("ignore_index", -100)
                spec = CrossEntropySpec(f"vocab_cross_entropy_{node.name}{suffix}", e.starts[r], e.counts[r], e.valid[r],
                                        ignore, red, sum(e.valid))
                modules.append(spec)
                env[node] = g.call_module(spec.module, (args[0], args[1]))
                break
        if node in env:
            continue
        bias = None
        target = node.target
        if row is not None and row.bias_arg is not None and len(args) > row.bias_arg:
            bias = args[row.bias_arg]
            if target == aten.addmm.default:        # addmm(b, x, W) -> mm(x, W) + b
                target, args = aten.mm.default, args[1:3]
            else:
                args = args[:row.bias_arg]
        if node.op == "call_function" and draws_randomly(op := op_name(target), tuple(args), kwargs):
            region, prefix = ("tensor_parallel", "tp") if _sharded_out(ns) else ("replicated", "replicated")
            spec = RandomOpSpec(f"{prefix}_rng_{node.name}{suffix}", target, region, RANDOM_OPS[op])
            modules.append(spec)
            new = g.create_node("call_module", spec.module, tuple(args), kwargs, name=node.name)
        else:
            new = g.create_node(node.op, target, tuple(args), kwargs, name=node.name)
        new.meta = {k: v for k, v in node.meta.items() if k in ("nn_module_stack", "stack_trace")}
        new.meta["captured"] = node.name          # the captured node it comes from (its shapes are there)
        if lookup_outside is not None:
            mask = g.call_function(aten.unsqueeze.default, (lookup_outside, -1))
            new = g.call_function(aten.masked_fill.Scalar, (new, mask, 0.0))
            scatter = next((e for e in ns.edits if isinstance(e, SequenceScatter)), None)
            new = seq_collective("reduce_scatter", f"reduce_scatter_to_sequence_{node.name}", scatter.dim,
                                 scatter.outer, new) if scatter else g.call_module("g", (new,))

        if row is not None:      # partial sums: reduce (g), or reduce-scatter onto sequence shards
            new = seq_collective("reduce_scatter", f"reduce_scatter_to_sequence_{node.name}", *row.scatter, new) \
                if row.scatter is not None else g.call_module("g", (new,))
            new.meta["shape_of"] = node.name         # the captured linear's (its single-device shape)
            if bias is not None:     # added once, after the reduction
                new = g.call_function(aten.add.Tensor, (new, bias))
                new.meta["shape_of"] = node.name
        env[node] = new
    g.lint()
    return RankGraph(g, modules, buffers)


def _size_of(gm: fx.GraphModule, target: str, use: ParamUse) -> int:
    return int(gm.get_parameter(target).shape[use.dim])
