"""The compile's passes for one input signature, in order, and for one rank.

`autoshard()` runs them for the example inputs; a program runs them again for each new input
signature (or mode, or autocast state) a call brings:

    compile_signature: capture (torch.export) -> normalize: alias ops as the ops they alias,
                       expert matmuls (bmm / einsum forms as ops), per-head norms (a list of
                       LayerNorms over split heads as one op), flattened rows kept in their shape
                       -> annotate (sharding analysis, writes node.meta)
    rank_graph:        rewrite (rank r's graph and its collectives)
                       -> context (cp > 1: context-parallel rank c's tokens, keys and values gathered)
                       -> fp8 (precision="fp8": linears as float8 matmuls, but for a table's)
                       -> fuse (optional)
                       -> tables (size-only values outlined into one cached call)
                       -> causal attention (SDPA with a causal table mask takes SDPA's causal path)
                       -> experts (ep > 1: each experts call outlined into one expert-parallel call)
                       -> recompute (optional: regions outlined into checkpointed calls)

Annotation comes before any rewrite so that every rank is cut from one decision; the rewrite is per
rank so that ranks are built lazily (a torchrun process builds only its own); fusion comes after
the rewrite so that fused ops see the shards and the collectives.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.fx as fx

from autoshard.compile.capture import Captured, capture
from autoshard.regions.experts_call import expert_count, expert_modules, weightless_copy
from autoshard.compile.new_signature import new_plan_refusal, sharding_clash
from autoshard.compile.static_shapes import sequence_length, symbolic_shapes, twin_length, with_length
from autoshard.compile.weights import WeightSource
from autoshard.errors import ShardingError
from autoshard.module_paths import fetch_attr
from autoshard.passes.causal_attention import specialize_attention
from autoshard.passes.context.split import split_context
from autoshard.passes.expert_matmuls import rewrite_expert_matmuls
from autoshard.passes.merged_dims import keep_merged_dims
from autoshard.passes.op_aliases import rewrite_op_aliases
from autoshard.passes.outline_experts import outline_experts
from autoshard.passes.per_head_norms import rewrite_per_head_norms
from autoshard.passes.fp8_linears import Fp8Options, fp8_table, rewrite_fp8_linears
from autoshard.passes.fusion.fuse import fuse
from autoshard.passes.recompute import outline_recompute
from autoshard.passes.rewrite.rank_rewrite import RankGraph, rewrite_rank
from autoshard.passes.rewrite.retarget import retarget_device, retarget_nodes
from autoshard.passes.sharding.annotate import ShardingPlan, annotate
from autoshard.passes.sharding.options import ShardOptions
from autoshard.passes.tables import outline_tables

__all__ = ["Compiled", "Compiler"]


@dataclass
class Compiled:
    """One input signature's captured graph and the sharding decided on it."""

    captured: Captured
    plan: ShardingPlan
    index: int            # 0 for the example inputs; names this graph's modules apart from the others'
    # cp > 1 with sequence parallelism (a static graph): captured node name -> sizes in the sequence length
    symbolic: dict[str, object] | None = None
    # traced from the released model's meta skeleton: the device its graph was retargeted to
    device: torch.device | None = None


class Compiler:
    """Runs the passes for one model and tp; keeps every signature compiled so far (`compiled`)."""

    def __init__(self, source: WeightSource, tp: int, options: ShardOptions, *, fuse: bool,
                 example_inputs: dict[str, object], recompute: str = "none", ep: int = 1, cp: int = 1,
                 cp_attention: str = "auto", cp_choose: Callable[[dict], str] | None = None,
                 fp8: Fp8Options | None = None):
        self.source, self.tp, self.options, self.fuse, self.fp8 = source, tp, options, fuse, fp8
        self.recompute, self.ep, self.cp, self.cp_attention = recompute, ep, cp, cp_attention
        self.cp_choose = cp_choose      # cp_attention="auto": the cost model's pick, given a call's sizes
        # experts modules without their weights (their code, for expert parallelism's calls)
        experts = expert_modules(source.model)
        self.expert_templates = {path: weightless_copy(m) for path, m in experts.items()} if ep > 1 else {}
        # read here, while the model is held: a new signature after distributed() has only its skeleton
        self.expert_paths = frozenset(experts)
        self.example_inputs = example_inputs       # named in refusals of signatures that shard differently
        self.compiled: list[Compiled] = []

    def compile_signature(self, named: dict[str, object], training: bool | None = None) -> Compiled:
        """capture -> annotate. A later signature whose sharding differs from the first's is refused
        (the ranks' parameters are cut once), naming the input and the parameter."""
        model, device = self.source.for_capture()
        cap = capture(model, named, dynamic=not self.options.sequence_parallel, training=training)
        if device is not None:       # traced from the released model's meta skeleton
            retarget_device(cap.gm, device)
        normalize(cap)
        plan = annotate(cap.gm, self.tp, cap.param_names, self.options)
        if self.compiled:
            first = self.compiled[0]
            clash = sharding_clash(first.captured, first.plan, cap, plan)
            if clash is not None:
                raise ShardingError(new_plan_refusal(named, self.example_inputs, first.plan, plan, clash))
        entry = Compiled(cap, plan, len(self.compiled), self._symbolic(model, named, cap, training), device)
        self.compiled.append(entry)
        return entry

    def _symbolic(self, model, named: dict[str, object], cap: Captured, training: bool | None) -> dict | None:
        """cp > 1 on a static graph (sequence parallelism): its sizes in the sequence length, read
        against a twin export at another length (compile/static_shapes.py)."""
        if self.cp == 1 or not self.options.sequence_parallel:
            return None
        seq = sequence_length(named)
        if seq % (2 * self.cp) or (seq // self.cp) % self.tp:
            raise ShardingError(f"cp={self.cp} with sequence parallelism at tp={self.tp}: a sequence of {seq} tokens "
                                f"must split in 2 * cp = {2 * self.cp} pieces, and each rank's {seq} / cp tokens "
                                f"over tp={self.tp} ranks; pad it to a multiple of {2 * self.cp * self.tp}")
        other = twin_length(seq, 2 * self.cp * self.tp)
        twin = capture(model, with_length(named, seq, other), dynamic=False, training=training)
        normalize(twin)
        return symbolic_shapes(cap.gm, twin.gm, seq, other)

    def rank_graph(self, entry: Compiled, r: int, cp_rank: int = 0) -> RankGraph:
        """rewrite -> context -> fp8 -> fuse -> tables -> causal attention -> experts -> recompute: tensor-parallel
        rank r's graph of one compiled signature (of context-parallel rank `cp_rank` when cp > 1)."""
        cap = entry.captured
        suffix = f"_s{entry.index}" if entry.index else ""
        rg = rewrite_rank(cap.gm, entry.plan, cap.param_names, r, suffix)
        by_name = {n.name: n for n in cap.gm.graph.nodes}
        attr = lambda target: rg.restrict_buffers[target] if target in rg.restrict_buffers \
            else fetch_attr(cap.gm, target)   # noqa: E731
        value = lambda n: attr(n.target) if n.op == "get_attr" else _example_value(n, by_name)   # noqa: E731
        if self.cp > 1:         # before fusion and tables: they then see the rank's cut masks and gathers
            symbolic = None if entry.symbolic is None else \
                (lambda n: entry.symbolic.get(n.meta.get("captured", n.name if n.op == "placeholder" else None)))
            rg.context = split_context(rg.graph, cp=self.cp, rank=cp_rank, value=value, param_names=cap.param_names,
                                       suffix=suffix, token_wise=set(self.expert_paths),
                                       attention=self.cp_attention, choose=self.cp_choose, symbolic=symbolic)
            rg.modules.extend(rg.context.specs)
            if entry.device is not None:     # its token positions were placed on the traced (meta) device
                retarget_nodes(rg.graph, entry.device)
        if self.fp8 is not None:         # before fusion, which would otherwise take a linear's bias out
            rg.modules.extend(rewrite_fp8_linears(rg.graph, self.fp8_table(entry), self.fp8.recipe,
                                                  cap.param_names.get, self._split_dim(entry), suffix, self.cp))
        if self.fuse:
            fuse(rg.graph, lambda target: fetch_attr(cap.gm, target), captured=cap.gm.graph, modules=rg.modules)
        rg.tables = outline_tables(rg.graph, attr, cap.param_names, "tables" + suffix, lambda n: _example_value(n, by_name))
        specialize_attention(rg.graph, rg.tables)
        if self.ep > 1:
            counts = {path: expert_count(m) for path, m in self.expert_templates.items()}
            rg.experts = outline_experts(rg.graph, counts, value, cap.param_names, self.ep, suffix)
        if self.recompute != "none":       # last: a recomputed region runs the same ops as the plain graph
            rg.regions = outline_recompute(rg.graph, self.recompute, lambda n: by_name.get(n.meta.get("captured")),
                                           suffix)
        return rg


    def _split_dim(self, entry: Compiled) -> Callable[[str], int | None]:
        """The dim of a parameter tensor parallelism splits, else None."""
        return lambda name: getattr(entry.plan.params.get(name), "dim", None)

    def fp8_table(self, entry: Compiled) -> dict[str, str | None]:
        """precision="fp8": each linear weight -> None (FP8) or why it stays bf16 (passes/fp8_linears.py)."""
        def shards(name: str, shape: list[int]) -> list[list[int]]:
            use = entry.plan.params.get(name)
            if use is None or use.dim is None:
                return [shape]
            return [[sum(b - a for a, b in lay) if d == use.dim else n for d, n in enumerate(shape)]
                    for lay in use.layout]
        return fp8_table(entry.captured.gm, entry.captured.param_names.get, shards, self.fp8.keep)


def normalize(cap: Captured) -> None:
    """The captured graph's spellings that the sharding table reads as one thing, rewritten as that
    thing (each pass leaves anything not exactly its pattern as written)."""
    rewrite_op_aliases(cap.gm)                          # torch.multiply as mul, torch.concatenate as cat, ...
    rewrite_expert_matmuls(cap.gm, cap.param_names)     # experts' bmm / einsum: ops the analysis knows
    rewrite_per_head_norms(cap.gm)                      # a LayerNorm module per head: one op
    keep_merged_dims(cap.gm)                            # [B, T, heads, D] -> [-1, D], [B, heads, ..] -> [B*heads, ..]: kept


def _example_value(n: fx.Node, captured: dict[str, fx.Node]) -> object:
    """A rank node's example value: its own, else the captured node's it was made from; `...` if unknown."""
    if "val" in n.meta:
        return n.meta["val"]
    src = captured.get(n.meta.get("captured", n.name if n.op == "placeholder" else None))
    return src.meta.get("val", ...) if src is not None else ...
