"""Size-only tables: what a graph computes from sizes, buffers and constants, outlined to be cached.

    tables = outline_tables(graph, lookup, param_names, "tables", value_of)   # graph edited in place, or None

Models build attention masks, position ids and rotary cos/sin tables in every forward from the
input's sizes and their buffers (Hugging Face's Llama: ~40 small ops before the first layer). A
pipeline stage recomputes them for every microbatch (passes/stages.py recomputes such nodes in each
stage that reads them), so an interleaved pipeline pays for them once per microbatch and chunk.

A node is size-only when its value follows from sizes and buffers alone:
- a `sym_size` / `sym_numel` / `sym_stride` read (of any tensor: a size is not the data);
- a buffer (`get_attr` of a tensor that is neither a parameter nor requires grad);
- a non-tensor input (an int, bool or None argument of the call);
- a pure op (no mutated argument, not random) of size-only values.

The computed size-only nodes become one `call_module` (autoshard/regions/tables.py's TableCache),
whose inputs are the sizes, buffers and non-tensor inputs they read: it runs its body once per
distinct inputs (sizes equal, the same buffer objects at the same version) and hands back the same
tensors afterwards. The values are those the graph computed (the same ops on the same inputs), so
a program gives bit-for-bit the results it gave before.

Nothing is outlined when caching could be seen: a graph output that is a table (the caller could
modify it), a mutating op reading a table or one of its buffers (the cache would hold a stale or
modified value), or no tensor among the tables (nothing to save).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.fx as fx

from autoshard.passes.outline import outline, stable_toposort

__all__ = ["TABLES", "TableRegion", "outline_tables", "size_only_nodes"]

TABLES = "tables"                       # node.meta key of the cache's call (passes/stages.py reads it)
aten = torch.ops.aten
_SIZE_READS = {aten.sym_size.int, aten.sym_numel.default, aten.sym_stride.int}


@dataclass
class TableRegion:
    """The outlined tables: the module name the call uses and its body (inputs in call order)."""
    name: str
    graph: fx.Graph


def _pure(target: object) -> bool:
    schema = getattr(target, "_schema", None)
    if schema is None:          # Python operators on sizes (operator.mul, getitem)
        return getattr(target, "__module__", None) in ("operator", "_operator")
    return not schema.is_mutable and torch.Tag.nondeterministic_seeded not in getattr(target, "tags", ())


def _is_tensor(n: fx.Node, value_of: Callable[[fx.Node], object]) -> bool:
    val = value_of(n)
    if val is not ...:
        return isinstance(val, torch.Tensor)
    schema = getattr(n.target, "_schema", None)
    return schema is not None and len(schema.returns) == 1 and isinstance(schema.returns[0].type, torch.TensorType)


def size_only_nodes(graph: fx.Graph, lookup: Callable[[str], object], param_names,
                    value_of: Callable[[fx.Node], object]) -> tuple[set[fx.Node], set[fx.Node]]:
    """(computed size-only nodes, the size-only leaves they may read: size reads of other tensors,
    buffers, non-tensor inputs). `value_of(node)` is the node's example value, `...` if unknown."""
    size_only: set[fx.Node] = set()
    computed: set[fx.Node] = set()
    for n in graph.nodes:
        if n.op == "placeholder":
            val = value_of(n)
            if val is not ... and not isinstance(val, torch.Tensor):     # unknown: treated as data
                size_only.add(n)
        elif n.op == "get_attr":
            if n.target in param_names:
                continue
            try:
                t = lookup(n.target)
            except AttributeError:
                continue
            if isinstance(t, torch.Tensor) and not isinstance(t, torch.nn.Parameter) and not t.requires_grad:
                size_only.add(n)
        elif n.op == "call_function":
            if n.target in _SIZE_READS:
                size_only.add(n)
                if n.args[0] in size_only:
                    computed.add(n)
            elif _pure(n.target) and all(a in size_only for a in n.all_input_nodes):
                size_only.add(n)
                computed.add(n)
    return computed, size_only - computed


def _untangle(graph: fx.Graph, region: set[fx.Node]) -> None:
    """Drop from `region` every node reading (through nodes outside it) a value of the region: one
    call cannot both feed and read a node outside it."""
    changed = True
    while changed:
        changed = False
        after: set[fx.Node] = set()           # outside the region, with an ancestor in it
        for n in graph.nodes:
            if n in region:
                if any(a in after for a in n.all_input_nodes):
                    region.discard(n)
                    changed = True
                    after.add(n)
            elif any(a in region or a in after for a in n.all_input_nodes):
                after.add(n)


def outline_tables(graph: fx.Graph, lookup: Callable[[str], object], param_names, name: str,
                   value_of: Callable[[fx.Node], object] = lambda n: n.meta.get("val", ...)) -> TableRegion | None:
    """Outline `graph`'s size-only tables into one `call_module` named `name`; None when there is
    nothing worth caching or caching could be observed (see the module docstring). `lookup(target)`
    gives a `get_attr`'s tensor, `value_of(node)` a node's example value (`...` if unknown)."""
    region, leaves = size_only_nodes(graph, lookup, param_names, value_of)
    _untangle(graph, region)
    if not any(_is_tensor(n, value_of) for n in region):
        return None
    output = next(n for n in graph.nodes if n.op == "output")
    if any(a in region for a in output.all_input_nodes):
        return None
    read = region | {a for n in region for a in n.all_input_nodes if a in leaves and a.op == "get_attr"}
    for n in graph.nodes:
        if n.op == "call_function" and n not in region and not _pure(n.target) \
                and getattr(n.target, "_schema", None) is not None and n.target._schema.is_mutable \
                and any(a in read for a in n.all_input_nodes):
            return None
    inputs = {a for n in region for a in n.all_input_nodes if a not in region}
    order = {n: i for i, n in enumerate(graph.nodes)}
    last_input = max(inputs, key=order.__getitem__, default=None)
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    after = placeholders[-1] if last_input is None or last_input.op == "placeholder" else last_input
    _, body = outline(graph, region, name, after=after, meta={TABLES: True})
    stable_toposort(graph, "tables")
    graph.lint()
    return TableRegion(name, body)
