"""A stage's backward in two halves: B, the gradients of the stage's inputs (what the previous
stage waits for), and W, the gradients of its parameters (free to run later: Qi et al. 2023).

    work = backward_input(outputs, output_grads, inputs, params)   # B: returns the input gradients
    ...                                                            # other actions
    backward_weight(work)                                          # W: accumulates into .grad

B runs autograd on the stage's inputs alone, with the graph kept, so the engine skips every
branch that only leads to a parameter (a linear layer's weight-gradient matmul, say). Before it
runs, each parameter's *frontier* is found in the autograd graph: the nodes where a value computed
from the parameter alone (the parameter, its transpose, its bf16 copy...) meets the activations
flowing from the inputs. B keeps the gradient arriving at each frontier node (a pre-hook). W starts
from those nodes with those gradients and runs only the parameter side: each parameter's gradient
is computed once, from exactly what B left. Parameters whose frontiers are linked (a weight used
twice in one stage, one use feeding the other) share one W call in which the saved gradients
replace what would flow between the frontier nodes, so nothing is counted twice. A stage output
computed from parameters alone (the first stage's, which has no inputs) is a frontier of its own,
started from its received gradient. The first stage has no input that needs a gradient: the
runtime taps the outputs of its first ops that read both the batch and a weight (an embedding, a
first matmul: runtime/stage_actions.py's ChunkParams) and passes them as its inputs, so its B runs
down to them and its W does the rest. A stage with no input needing a gradient at all has nothing
to split: its B is the whole backward and its W is empty.

Each parameter's `.grad` is accumulated once per microbatch, by its group's engine call in W: the
gradient buffers' hooks (runtime/grad_buffer.py) count one arrival per microbatch, so a bucket's
reduction starts when its last W is done. `keep_in_b` names parameters whose gradient B
computes itself (those inside a recomputed region: computing them in W would run the region a
second time); they are accumulated with the others at W.

Collectives on the activation path (tensor parallelism's f and g, sequence parallelism's gathers,
experts' all-to-all, ring attention's exchanges) run in B; W runs only what leads to parameters,
in the same order on every tensor-parallel rank (frontier groups are ordered by the forward's
sequence numbers, not by object identity).
"""
from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, Node

__all__ = ["WeightWork", "backward_input", "backward_weight"]


def _node_of(t: torch.Tensor) -> Node | None:
    """The autograd node a tensor's gradient enters: its grad_fn, or a leaf's accumulator."""
    if t.grad_fn is not None:
        return t.grad_fn
    if t.requires_grad:
        return t.view_as(t).grad_fn.next_functions[0][0]
    return None


def _consumers(roots: list[Node]) -> dict[Node, list[Node]]:
    """node -> the nodes whose gradient flows into it (its users in the forward), from `roots` down."""
    users: dict[Node, list[Node]] = defaultdict(list)
    seen, queue = set(roots), deque(roots)
    while queue:
        node = queue.popleft()
        for nxt, _ in node.next_functions:
            if nxt is None:
                continue
            users[nxt].append(node)
            if nxt not in seen:
                seen.add(nxt)
                queue.append(nxt)
    return users


def _upward(starts: list[Node], users: dict[Node, list[Node]], stop: set[Node]) -> tuple[set[Node], set[Node]]:
    """Nodes reached from `starts` going toward the outputs, not passing `stop` nodes; and the
    `stop` nodes met."""
    reached, met = set(starts), set()
    queue = deque(starts)
    while queue:
        for user in users.get(queue.popleft(), ()):
            if user in stop:
                met.add(user)
            elif user not in reached:
                reached.add(user)
                queue.append(user)
    return reached, met


Edge = tuple[Node, int]       # a node and one of its forward outputs


@dataclass
class _Group:
    """Parameters whose frontiers are linked, and where W starts for them."""
    params: list[torch.Tensor]
    frontier: list[Node]                      # B captures the gradient arriving at each
    seeds: dict[Edge, torch.Tensor]           # outputs computed from parameters alone: their gradients
    grads: dict[Node, tuple] = field(default_factory=dict)

    def order(self) -> int:
        return max([n._sequence_nr() for n in self.frontier] + [n._sequence_nr() for n, _ in self.seeds], default=0)


@dataclass
class WeightWork:
    """What W needs from B: the frontier groups with their captured gradients, and the gradients B
    computed itself (`keep_in_b`)."""
    groups: list[_Group]
    done: list[tuple[torch.Tensor, torch.Tensor]]


def _groups(outputs: list[torch.Tensor], output_grads: list[torch.Tensor], inputs: list[torch.Tensor],
            params: list[torch.Tensor]) -> list[_Group]:
    """The frontier groups of `params` in the graph from `inputs` to `outputs` (see the module doc)."""
    users = _consumers([o.grad_fn for o in outputs])
    starts = [n for n in map(_node_of, inputs) if n is not None and n in users]
    from_inputs, _ = _upward(starts, users, set())          # the starts included
    seed_grads = {(o.grad_fn, o.output_nr): g for o, g in zip(outputs, output_grads) if o.grad_fn not in from_inputs}
    seed_nodes = {node for node, _ in seed_grads}
    keys: list[set[Node]] = []
    found: list[tuple[torch.Tensor, set[Node], set[Edge]]] = []
    for p in params:
        node = _node_of(p)
        if node is None or node not in users:
            continue                           # not read by this stage
        reached, met = _upward([node], users, from_inputs)
        seeds = {e for e in seed_grads if e[0] in reached}
        if met or seeds:
            found.append((p, met, seeds))
            keys.append(met | {n for n in reached if n in seed_nodes})
    # parameters sharing a frontier or seed node are one group (union-find over the list)
    parent = list(range(len(found)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i
    owner: dict[Node, int] = {}
    for i, k in enumerate(keys):
        for n in k:
            if n in owner:
                parent[root(i)] = root(owner[n])
            else:
                owner[n] = i
    merged: dict[int, _Group] = {}
    for i, (p, met, seeds) in enumerate(found):
        g = merged.setdefault(root(i), _Group([], [], {}))
        g.params.append(p)
        g.frontier += [n for n in met if n not in g.frontier]
        g.seeds.update({e: seed_grads[e] for e in seeds})
    return sorted(merged.values(), key=lambda g: -g.order())     # as backward would meet them


def backward_input(outputs: list[torch.Tensor], output_grads: list[torch.Tensor | None],
                   inputs: list[torch.Tensor], params: list[torch.Tensor],
                   keep_in_b: list[torch.Tensor] = ()) -> tuple[list[torch.Tensor | None], WeightWork]:
    """B: the gradients of `inputs` (None where an input gets none), and what W needs to compute
    the gradients of `params` later. `output_grads[i]` None means ones (a loss)."""
    pairs = [(o, torch.ones_like(o) if g is None else g) for o, g in zip(outputs, output_grads)
             if o.requires_grad and o.grad_fn is not None]
    outs, grads = [o for o, _ in pairs], [g for _, g in pairs]
    wanted = [t for t in inputs if t.requires_grad]
    if not wanted:
        # No input gradient for anyone to wait for (a first stage with nothing tapped, or all its
        # weights frozen): B is the whole backward (the graph is freed at once, and W, with nothing
        # left, costs nothing). Split, W would start from the outputs and run the stage's
        # collectives and recomputed regions a second time.
        if outs:
            torch.autograd.backward(outs, grads)
        return [None] * len(inputs), WeightWork([], [])
    kept_ids = {id(p) for p in keep_in_b}
    groups = _groups(outs, grads, wanted,
                     [p for p in params if p.requires_grad and id(p) not in kept_ids]) if outs else []
    handles = []
    for g in groups:
        for node in g.frontier:
            def capture(grad_outputs, g=g, node=node):
                g.grads[node] = tuple(grad_outputs)
            handles.append(node.register_prehook(capture))
    kept = [p for p in keep_in_b if p.requires_grad]
    try:
        got = torch.autograd.grad(outs, wanted + kept, grads, retain_graph=True, allow_unused=True) \
            if outs else [None] * (len(wanted) + len(kept))
    finally:
        for h in handles:
            h.remove()
    # An input that is itself a frontier node's output (the first stage's taps: an embedding's rows,
    # a first matmul's output) got its gradient from the engine, not through a pre-hook.
    frontier = {node: g for g in groups for node in g.frontier}
    for t, d in zip(wanted, got):
        g = frontier.get(t.grad_fn)
        if g is not None and d is not None and t.grad_fn not in g.grads:
            g.grads[t.grad_fn] = tuple(d if k == t.output_nr else None for k in range(t.output_nr + 1))
    by_input = iter(got[:len(wanted)])
    input_grads = [next(by_input) if t.requires_grad else None for t in inputs]
    done = [(p, d) for p, d in zip(kept, got[len(wanted):]) if d is not None]
    return input_grads, WeightWork(groups, done)


def backward_weight(work: WeightWork) -> None:
    """W: the parameter gradients from what B left, accumulated into `.grad` once per parameter
    (the groups partition the parameters; each group's engine call accumulates its own, as a whole
    backward would, without a copy)."""
    if work.done:
        torch.autograd.backward([p for p, _ in work.done], [d for _, d in work.done])
    for g in work.groups:
        edges: list[GradientEdge] = []
        seeds: list[torch.Tensor] = []
        for node in g.frontier:
            for i, x in enumerate(g.grads.get(node, ())):
                if x is not None:
                    edges.append(GradientEdge(node, i))
                    seeds.append(x)
        for (node, nr), x in g.seeds.items():
            edges.append(GradientEdge(node, nr))
            seeds.append(x)
        if not edges:
            continue
        # linked frontier nodes: what flows between them in W was already counted in B's capture
        clamps = [node.register_prehook(lambda _, saved=g.grads[node]: saved)
                  for node in g.frontier if node in g.grads] if len(g.frontier) > 1 else []
        try:
            torch.autograd.backward(edges, seeds, retain_graph=True, inputs=g.params)
        finally:
            for h in clamps:
                h.remove()
    work.groups.clear()
    work.done.clear()
