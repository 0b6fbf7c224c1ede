"""The state one rank's rewrite shares between its nodes and its edits (edits.py): the new graph,
what each captured node became, the f of each replicated value, the sequence gathers, the modules
and buffers emitted; and the reads every node needs (parameters, inputs entering a sharded region,
the outputs gathered)."""
from __future__ import annotations

import torch
import torch.fx as fx

from autoshard.parallel.registry import ModuleSpec
from autoshard.parallel.sequence_parallel import SequenceSpec
from autoshard.parallel.tensor_parallel import SyncSpec
from autoshard.parallel.vocab_parallel import GatherSpec
from autoshard.passes.graph_reading import param_read
from autoshard.passes.rewrite.grad_flow import grad_flow
from autoshard.passes.sharding.annotate import ShardingPlan
from autoshard.passes.sharding.index_sets import is_even_chunks, is_partition
from autoshard.passes.sharding.placement import GatherOutputs, NodeSharding, ParamUse, Shard

__all__ = ["RankRewrite", "sharded_out"]


class RankRewrite:
    """The state of one rank's rewrite, which the edits (edits.py) read and extend."""

    def __init__(self, gm: fx.GraphModule, plan: ShardingPlan, param_names: dict[str, str], r: int, suffix: str):
        self.gm, self.plan, self.param_names, self.r, self.suffix = gm, plan, param_names, r, suffix
        self.g = fx.Graph()
        self.needs_grad = grad_flow(gm)
        self.env: dict[fx.Node, fx.Node] = {}
        self.f_of: dict[fx.Node, fx.Node] = {}         # one f per replicated value entering a sharded region
        self.modules: list[ModuleSpec] = []
        self.gathered: dict[fx.Node, fx.Node] = {}
        self.tokens_of: dict[fx.Node, fx.Node] = {}    # sequence-parallel values gathered to full length
        self.buffers: dict[str, torch.Tensor] = {}

    def read_entering(self, n: fx.Node) -> fx.Node:
        """An input of a node whose output is sharded: replicated values come in through f."""
        read_param = param_read(n, self.param_names)
        local_shard = read_param is not None and read_param[0] in self.plan.params
        if _replicated(n) and self.needs_grad(n) and not local_shard:
            if n not in self.f_of:
                self.f_of[n] = self.g.call_module("f", (self.env[n],))
            return self.f_of[n]
        return self.env[n]

    def seq_collective(self, kind: str, name: str, dim: int, outer: int, x: fx.Node) -> fx.Node:
        spec = SequenceSpec(f"{name}{self.suffix}", kind, dim, outer)
        self.modules.append(spec)
        return self.g.call_module(spec.module, (x,))

    def gather_out(self, n: fx.Node, ns: NodeSharding) -> fx.Node:
        """A value the model returns: gathered to full size if sharded (unless asked not to)."""
        p = n.meta["sharding"].placement
        want = any(isinstance(e, GatherOutputs) and e.gather for e in ns.edits)
        if not isinstance(p, Shard) or not want:
            return self.env[n]
        if n not in self.gathered:
            spec = GatherSpec(f"gather_{n.name}{self.suffix}", p.dim, p.size, int(n.meta["val"].shape[p.dim]),
                              p.layout[self.r], is_even_chunks(tuple(map(tuple, p.layout)), p.size))
            self.modules.append(spec)
            self.gathered[n] = self.g.call_module(spec.module, (self.env[n],))
        return self.gathered[n]

    def param(self, node: fx.Node) -> fx.Node:
        """A parameter read: this rank's shard, synchronised where ranks share rows."""
        name = self.param_names[node.target]
        new = self.g.get_attr(name)
        use = self.plan.params.get(name)
        size = use and (use.padded or _size_of(self.gm, node.target, use))
        if use is not None and not is_partition(use.layout, size):   # rows shared between ranks
            spec = SyncSpec(_sync_name(name), name, use.dim, size, use.layout[self.r])
            self.modules.append(spec)
            new = self.g.call_module(spec.module, (new,))
        return new


def _sync_name(param: str) -> str:
    return "sync_" + param.replace(".", "_")


def sharded_out(ns: NodeSharding) -> bool:
    outs = ns.placement if isinstance(ns.placement, tuple) else (ns.placement,)
    return any(isinstance(p, Shard) for p in outs)


def _replicated(n: fx.Node) -> bool:
    ns = n.meta.get("sharding")
    return ns is None or not sharded_out(ns)


def _size_of(gm: fx.GraphModule, target: str, use: ParamUse) -> int:
    return int(gm.get_parameter(target).shape[use.dim])
