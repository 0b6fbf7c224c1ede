"""What the plan says about weights it leaves whole: fallbacks trimmed to what stayed replicated,
and a reason for every other 2-D (or larger) weight of a repeated block that stays whole.

Runs after the analysis, reading only the plan and the graph. A weight of a repeated block
(a module path with a layer index, `model.layers.3.mlp...`) that no region shards is either named
by a fallback, or gets a line here naming the node that reads it and why that node does not shard
it, so `print(prog)` never leaves a large replicated weight unexplained (MoE experts stored as one
3-D tensor and read by an op the table does not know, for instance).
"""
from __future__ import annotations

import re
from dataclasses import replace

import torch.fx as fx

from autoshard.passes.graph_reading import module_path, op_name, param_read
from autoshard.passes.sharding.op_table import RULES
from autoshard.passes.sharding.placement import Fallback, ParamUse

__all__ = ["Fallback", "trim_fallbacks", "unexplained_replicated", "with_first_cause"]


_VIEWS = frozenset(["t", "transpose", "permute", "view", "reshape", "_unsafe_view", "unsqueeze", "squeeze",
                    "expand", "contiguous", "clone", "to", "_to_copy", "alias", "detach", "unflatten", "flatten"])
_BLOCK = re.compile(r"\.\d+\.")


def _weights_read(node: fx.Node, param_names: dict[str, str]) -> set[str]:
    return {hit[0] for a in node.all_input_nodes if (hit := param_read(a, param_names)) is not None}


def trim_fallbacks(fallbacks: list, by_name: dict[str, fx.Node], params: dict[str, ParamUse],
                   param_names: dict[str, str]) -> list:
    """Fallbacks whose roots' weights all ended up sharded (a later visit split them) are dropped;
    the others keep only their roots still replicated."""
    out = []
    for f in fallbacks:
        kept = []
        for r in f.roots:
            weights = _weights_read(by_name[r], param_names) if r in by_name else None
            if weights is not None and not (weights and weights <= set(params)):
                kept.append(r)
        if kept:
            out.append(replace(f, roots=tuple(kept), modules=tuple(module_path(by_name[r]) for r in kept)))
    return out


def unexplained_replicated(gm: fx.GraphModule, params: dict[str, ParamUse], fallbacks: list,
                           param_names: dict[str, str]) -> list[str]:
    """One line per replicated weight of >= 2 dims in a repeated block that no fallback names."""
    by_name = {n.name: n for n in gm.graph.nodes}
    explained = {w for f in fallbacks for r in f.roots if r in by_name for w in _weights_read(by_name[r], param_names)}
    lines, seen = [], set()
    for n in gm.graph.nodes:
        if n.op != "get_attr" or n.target not in param_names:
            continue
        name = param_names[n.target]
        val = n.meta.get("val")
        shape = tuple(val.shape) if val is not None else ()
        if name in params or name in explained or name in seen or len(shape) < 2 or not _BLOCK.search(f".{name}"):
            continue
        seen.add(name)
        reader = _first_reader(n)
        if reader is None:
            continue
        op = op_name(reader.target) if reader.op == "call_function" else f"{reader.op} {reader.target}"
        why = (f"no sharding rule for {reader.target}" if reader.op == "call_function" and op not in RULES
               else f"{op} reads it whole (no tensor-parallel region reaches it)")
        lines.append(f"{name} {shape}: read by node {reader.name} (module {module_path(reader)}): {why}; "
                     f"kept whole on every rank")
    return lines


def _first_reader(node: fx.Node) -> fx.Node | None:
    """The first user past view-like ops (transposes, reshapes, casts) of a weight read."""
    frontier = list(node.users)
    while frontier:
        u = frontier.pop(0)
        if u.op == "call_function" and op_name(u.target) in _VIEWS:
            frontier.extend(u.users)
            continue
        return u
    return None


def with_first_cause(error: Exception, fallbacks: list, node: fx.Node) -> Exception:
    """A refusal raised at `node` after regions of the same module fell back for want of a rule is
    usually their consequence (queries left replicated make the values' heads look too few): the
    refusal then leads with that first cause, the op without a rule, and says the rest follows."""
    parent = module_path(node).split(" (")[0].rpartition(".")[0]
    causes = [f for f in fallbacks if not f.by_design
              and any(m.split(" (")[0].rpartition(".")[0] == parent for m in f.modules)]
    if not causes:
        return error
    first = causes[0]
    return type(error)(f"{first.reason}; this left {', '.join(first.modules)} replicated, and what follows "
                       f"from it is refused: {error}")
