"""Fuse: swap subgraphs of a rank graph for the fused ops of autoshard.kernels (runs after rewrite).

The rewrites are data: `RULES` is a table of (name, pattern, build). A pattern is a tree of `P`
(a call_function node with one of some targets, its arguments matched in turn), `V` (any value,
bound to a name, optionally tested by a check of passes/fusion/checks.py) and lists of those (a list
argument, item by item); a name bound twice must bind the same node or an equal constant; a node
with arguments its pattern does not name does not match. A match's inner nodes must have no other
users (export's dtype assertions aside; they go with them); `build` inserts the replacement before
the matched root and returns it. Rows are tried in order at every node.

    fused = fuse(graph, lookup, captured=captured_graph)   # -> [(rule name, root node name)], in place

On CUDA the ops run the CuPy kernels, elsewhere their exact torch implementations, so a fused graph
computes what the unfused one does, in the same dtypes under autocast: the element-wise ops and
rotary promote like the adds and products they replace, and a bias taken out of a linear is cast
to the linear's output dtype. Three exceptions, all under CUDA autocast only, where some ops run in
fp32: the written-out tanh GeLU's `pow`, so the unfused activation comes out fp32 where the fused
one has the input's dtype (the same fp32 arithmetic, rounded once; the GEMM that reads it casts to
the low precision either way); `layer_norm`, so a LayerNorm of bf16 activations returns fp32
unfused and bf16 fused (autocast's usual fp32 residual stream is not affected); and `softmax`, so
bf16 attention scores give fp32 probabilities unfused and bf16 fused (fp32 math inside either
way; the probabilities' matmul with v casts to bf16). The fused norm has no autocast rule:
registering one crashed torch (kernels/ops.py says how).

The ops broadcast like the torch code they replace, and their CUDA kernels fall back to the torch
implementation outside the plain case, so most patterns need no shapes. One does: the causal
softmax replaces `masked_fill(buf[:, :, :T, :T] == 0, -inf)` by the op's built-in causal mask only
where `buf` is causal (read at fuse time) and T is the scores' query and key length in the captured
program's shapes (passes/rewrite/rank_rewrite.py names each rank node's captured node in meta["captured"]).
A training dropout (p > 0) before a bias + residual add is fused too: the rewrite made it a module
that runs it under its RNG region's generator (rng.RegionRandomOp), a pattern matches that module as
the dropout it runs, and the fused op becomes such a module in the same region. It draws a seed
from the region's generator and the kernel hashes (seed, element) into its mask, regenerated in
backward: the same distribution and the same region rule (one mask on every rank of a replicated
region, a rank's own under sequence parallelism), not torch's mask, so a fused training run with
dropout is not the unfused run bit for bit. Biases and norm weights that sequence parallelism reads
through f (identity forward) match as the parameters they are.

Layouts: every fused op returns contiguous tensors whatever its inputs' strides, on every device,
as its fake implementation says (torch.compile plans with the fakes' strides). The norm and softmax
thereby match aten.layer_norm and aten.softmax, which graphs rely on (GPT-2 views a LayerNorm's
output as [-1, C]; under sequence parallelism its input is a reduce-scatter's output, whose
scattered dim is outermost in memory). An element-wise op of a permuted input is where a fused
graph's layout differs from the unfused one's (torch's element-wise ops keep the input's layout):
equal values; a later view that needed the permuted layout would fail loudly, none of ours does.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.fx as fx

from autoshard.parallel.random_ops import RANDOM_OPS
from autoshard.parallel.rng import RandomOpSpec
from autoshard.passes.fusion.pattern import ASSERTS, Facts, P, V, match
from autoshard.passes.fusion.rules import RULES
from autoshard.passes.graph_reading import op_name

__all__ = ["P", "V", "RULES", "Inserter", "fuse"]

aten = torch.ops.aten
# bound values a fusion may leave without users, removed with it (pure casts and views)
_PURE = (aten.to.dtype, aten.unsqueeze.default)


class Inserter:
    """What a builder inserts with, before the matched root: `call(target, args, like=root)` adds a
    call_function node carrying `like`'s meta (its module path places it in its pipeline stage);
    `call.captured(node)` is the node's value in the single-device program (Facts.captured);
    `call.random(module_node, op, args)` adds a call of `op` run under the generator region of
    `module_node` (a random op's module, autoshard/parallel/rng.py's RandomOpSpec) as a module of its own."""

    def __init__(self, graph: fx.Graph, root: fx.Node, modules: list,
                 captured: Callable[[fx.Node], object] = lambda node: None):
        self.graph, self.root, self.modules = graph, root, modules
        self.captured = captured      # Facts.captured: a node's value in the single-device program, or None

    def _meta(self, n: fx.Node, like: fx.Node) -> fx.Node:
        n.meta = {k: v for k, v in like.meta.items() if like is not self.root or k != "val"}
        return n

    def __call__(self, target, args: tuple, like: fx.Node | None = None, kwargs: dict | None = None) -> fx.Node:
        return self._meta(self.graph.call_function(target, args, kwargs), like or self.root)

    def random(self, module_node: fx.Node, op, args: tuple) -> fx.Node:
        spec = next(s for s in self.modules if isinstance(s, RandomOpSpec) and s.module == module_node.target)
        new = RandomOpSpec(spec.module.replace("_rng_", "_rng_fused_", 1), op, spec.region, RANDOM_OPS[op_name(op)])
        self.modules.append(new)
        return self._meta(self.graph.call_module(new.module, args), self.root)


def fuse(graph: fx.Graph, lookup: Callable[[str], object], rules: list[tuple[str, P, Callable]] | None = None,
         captured: fx.Graph | None = None, modules: list | None = None) -> list[tuple[str, str]]:
    """Apply `rules` (default RULES) to `graph` in place; `lookup(target)` gives a get_attr node's
    tensor. `captured`, the graph `graph` was rewritten from, gives rules the single-device shapes
    (a rule that needs them does not match without). `modules`, the rank graph's module specs
    (RankGraph.modules), lets random ops' modules match as their ops; it is edited in place: a
    module a fusion replaces goes, the fused one is added. Returns (rule, root node) per fusion."""
    import autoshard.kernels  # noqa: F401  (registers torch.ops.autoshard.*; only when fusing)
    modules = modules if modules is not None else []
    ops = {s.module: s.op for s in modules if isinstance(s, RandomOpSpec)}
    facts = Facts(lookup, _captured_values(captured) if captured is not None else (lambda node: None), ops.get)
    done = []
    for root in list(graph.nodes):
        if getattr(root, "_erased", False) or root.op != "call_function":
            continue                                  # erased by an earlier fusion, or not an op
        for name, pat, build in rules if rules is not None else RULES:
            env, inner = {}, []
            if not match(pat, root, env, inner, facts):
                continue
            with graph.inserting_before(root):
                new = build(Inserter(graph, root, modules, facts.captured), env, root)
            new.meta = {**root.meta, "fused": name, "replaces": root.name}
            root.replace_all_uses_with(new)
            graph.erase_node(root)
            for n in inner:                            # matched top-down: users before what they use
                for u in [u for u in n.users if u.target in ASSERTS and not u.users]:
                    graph.erase_node(u)
                if not n.users:
                    graph.erase_node(n)
                    if n.op == "call_module":          # its module goes with it
                        modules[:] = [s for s in modules if getattr(s, "module", None) != n.target]
            read = {id(v): v for v in env.values() if isinstance(v, fx.Node)}     # a node bound twice, once
            for v in read.values():                    # a cast or buffer the match read, now read by nothing
                if not v.users and (v.op == "get_attr" or v.target in _PURE):
                    graph.erase_node(v)
            done.append((name, root.name))
            break
    graph.lint()
    return done


def _captured_values(captured: fx.Graph) -> Callable[[fx.Node], object]:
    """node -> export's recorded value of the captured node it was rewritten from (passes/rewrite/rank_rewrite.py
    names it in meta["captured"]), or of the one whose shape it has (meta["shape_of"]: a row-parallel
    linear's reduction, and that plus its bias), or None."""
    by_name = {n.name: n for n in captured.nodes}

    def value(node: fx.Node) -> object:
        src = by_name.get(node.meta.get("captured") or node.meta.get("shape_of"))
        return None if src is None else src.meta.get("val")
    return value
