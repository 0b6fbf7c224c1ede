"""Outlining: a set of a graph's nodes moved into a body graph that one `call_module` node runs.

    call, body = outline(graph, region, "name", after=last_node)

The body's placeholders are the region's inputs (values made outside it, in graph order), its output
a tuple of the values read outside it. In the graph, one `call_module` node takes the inputs and
getitem nodes give back the outputs under the names they had, so later passes (stage splitting,
printing) see the same names. Used by recomputation (passes/recompute.py), size-only tables
(passes/tables.py) and expert parallelism (passes/outline_experts.py).
"""
from __future__ import annotations

import operator

import torch.fx as fx

from autoshard.errors import ShardingError

__all__ = ["between", "outline", "stable_toposort", "take_name"]


def take_name(node: fx.Node, new: str) -> str:
    """Rename `node` to `new` and free its old name for a node that replaces it (fx never frees a
    name otherwise, and the replacement would print as `name_1`); returns the old name."""
    old = node.name
    node._rename(new)
    node.graph._graph_namespace._used_names.discard(old)
    return old


def between(graph: fx.Graph, seeds: set[fx.Node]) -> set[fx.Node]:
    """`seeds` plus every node with an ancestor and a descendant among them."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    first, last = min(order[n] for n in seeds), max(order[n] for n in seeds)
    below: set[fx.Node] = set(seeds)
    for n in graph.nodes:          # descendants of the seeds, in order
        if first < order[n] <= last and any(a in below for a in n.all_input_nodes):
            below.add(n)
    above: set[fx.Node] = set(seeds)
    for n in reversed(graph.nodes):
        if first <= order[n] < last and any(u in above for u in n.users):
            above.add(n)
    return seeds | (below & above)


def outline(graph: fx.Graph, region: set[fx.Node], name: str, *, after: fx.Node,
            meta: dict | None = None) -> tuple[fx.Node, fx.Graph]:
    """Move `region` into a body graph called by a new `call_module` node `name` placed after
    `after`; returns (that node, the body). The caller reorders (`stable_toposort`) when a reader of
    an output sits before the call."""
    ordered = [n for n in graph.nodes if n in region]
    inputs: list[fx.Node] = []
    for n in ordered:
        for a in n.all_input_nodes:
            if a not in region and a not in inputs:
                inputs.append(a)
    outputs = [n for n in ordered if any(u not in region for u in n.users)]
    body = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for a in inputs:
        env[a] = body.placeholder(a.name)
        env[a].meta = dict(a.meta)
    for n in ordered:
        env[n] = body.node_copy(n, lambda a: env[a])
    body.output(tuple(env[n] for n in outputs))
    body.lint()
    for n in outputs:                      # the getitems take the names the values had
        take_name(n, f"{n.name}_outlined")
    with graph.inserting_after(after):
        call = graph.call_module(name, tuple(inputs))
    call.meta = dict(meta or {})
    cursor = call
    for k, n in enumerate(outputs):
        with graph.inserting_after(cursor):
            item = graph.create_node("call_function", operator.getitem, (call, k), name=n.name.removesuffix("_outlined"))
        item.meta = dict(n.meta)
        n.replace_all_uses_with(item, delete_user_cb=lambda u: u not in region)
        cursor = item
    for n in reversed(ordered):
        graph.erase_node(n)
    return call, body


def stable_toposort(graph: fx.Graph, what: str) -> None:
    """Reorder so every node follows its inputs, moving as little as possible (a reader of an
    outlined value that sat before the call moves after it). `what` names the pass in errors."""
    placed: set[fx.Node] = set()
    pending: list[fx.Node] = []
    order: list[fx.Node] = []
    for n in graph.nodes:
        pending.append(n)
        progress = True
        while progress:
            progress = False
            for m in list(pending):
                if all(a in placed for a in m.all_input_nodes):
                    pending.remove(m)
                    placed.add(m)
                    order.append(m)
                    progress = True
    if pending:
        raise ShardingError(f"{what}: cannot order node {pending[0].name} after its inputs")
    prev = None
    for n in order:
        if prev is not None and prev.next is not n:
            prev.append(n)
        prev = n
