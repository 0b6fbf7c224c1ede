"""Fully sharded data parallelism in a stage graph: which parameters form a unit, and where each unit
is gathered and released (PyTorch's FSDP2, ZeRO-3; here read off the graph, not hooked onto modules).

    units = param_units(graph, trainable)                  # [[names of layer 0], ..., [head's names]]
    graph = insert_unit_gathers(graph, unit_of, acquire, release, before_backward)

Units (`param_units`): one per repeated layer (passes/stages.py's `find_layers`), one for the
parameters outside the layers read before the first layer's (the embedding) and one for those read
after it (final norm, head); a parameter read by two units (a tied embedding read by the embedding
and the head) belongs to the first. In forward order, the order the gathers are issued in.

Calls (`insert_unit_gathers`), on a copy of the graph:
- `acquire(u, following)` before the first op that reads unit u's parameters (directly, or through ops
  on weights alone: a transpose, a cast), `following` the unit the graph reads next (its gather can
  start now, so that it overlaps u's compute), and `release(u)` after the last: forward holds a unit
  only while its ops run.
- `before_backward(value, units, previous)` on the output of every op where the batch meets unit
  weights (an op's backward reads the weights it saved): autograd runs it just before that op's
  backward, so it gathers the units again (and starts `previous`, the one backward reads next).
  A recomputed region reads its weights through its call's inputs, so its call is such an op and
  the recomputation finds them gathered. When backward releases a unit is the runtime's choice (once
  its gradients are in: runtime/sharded_params.py).
"""
from __future__ import annotations

import re
from typing import Callable, Hashable

import torch.fx as fx

from autoshard.errors import ShardingError
from autoshard.passes.graph_reading import weight_values
from autoshard.passes.stages import find_layers

__all__ = ["insert_unit_gathers", "param_units", "unit_reads"]

_OPS = ("call_function", "call_method", "call_module")


def unit_reads(graph: fx.Graph, unit_of: dict[str, Hashable]) -> tuple[dict[fx.Node, set], set[fx.Node]]:
    """For each op, the units whose parameters it reads (through weight-only ops too), and the ops
    computed from weights alone (they run in forward only on the weights: no activation meets them)."""
    weights = weight_values(graph)
    reads: dict[fx.Node, set] = {}
    for n in graph.nodes:
        if n.op == "get_attr":
            reads[n] = {unit_of[n.target]} if n.target in unit_of else set()
        elif n.op in _OPS:
            reads[n] = set().union(*(reads[a] for a in n.all_input_nodes if a in weights))
    return reads, weights


def param_units(graph: fx.Graph, names: list[str]) -> list[list[str]]:
    """`names` (parameters the graph reads) grouped into units, in forward order (module doc)."""
    try:
        prefix = find_layers(graph).path
    except ShardingError:                  # no repeated layers: the whole graph is one unit
        return [list(names)] if names else []
    layer = re.compile(re.escape(prefix) + r"\.(\d+)\.")
    wanted = set(names)
    position = {n: i for i, n in enumerate(graph.nodes)}
    first_use: dict[str, int] = {}
    first_layer = None
    for n in graph.nodes:
        if n.op != "get_attr" or n.target not in wanted:
            continue
        first_use.setdefault(n.target, min((position[u] for u in n.users), default=position[n]))
        if layer.match(n.target) and (first_layer is None or first_use[n.target] < first_layer):
            first_layer = first_use[n.target]
    keyed: dict[object, list[str]] = {}
    for name in sorted(first_use, key=first_use.get):
        m = layer.match(name)
        key = ("layer", int(m.group(1))) if m else \
            ("before" if first_layer is not None and first_use[name] < first_layer else "after",)
        keyed.setdefault(key, []).append(name)
    return list(keyed.values())


def insert_unit_gathers(graph: fx.Graph, unit_of: dict[str, Hashable], acquire: Callable, release: Callable,
                        before_backward: Callable) -> fx.Graph:
    """A copy of `graph` with the unit calls of the module doc; `unit_of` maps a parameter's name to
    its unit (parameters it does not name are left whole: frozen ones)."""
    copy = fx.Graph()
    copy.output(copy.graph_copy(graph, {}))
    reads, weights = unit_reads(copy, unit_of)
    ops = [n for n in copy.nodes if n.op in _OPS]
    first: dict[Hashable, fx.Node] = {}
    last: dict[Hashable, fx.Node] = {}
    for n in ops:
        for u in reads[n]:
            first.setdefault(u, n)
            last[u] = n
    order = list(first)                       # units in the order forward reads them
    following = {u: (order[k + 1] if k + 1 < len(order) else None) for k, u in enumerate(order)}
    previous = {u: (order[k - 1] if k > 0 else None) for k, u in enumerate(order)}
    for n in ops:
        if reads[n] and n not in weights:           # the batch meets weights: gather again before its backward
            units = tuple(sorted(reads[n], key=order.index))
            with copy.inserting_after(n):
                wrapped = copy.call_function(before_backward, (n, units, previous[units[0]]))
            n.replace_all_uses_with(wrapped, delete_user_cb=lambda user, w=wrapped: user is not w)
    for u in order:
        with copy.inserting_before(first[u]):
            copy.call_function(acquire, (u, following[u]))
        after = last[u]
        while after.next.op in _OPS and after.next.target is before_backward:
            after = after.next                      # past its own before_backward call
        with copy.inserting_after(after):
            copy.call_function(release, (u,))
    copy.lint()
    return copy
