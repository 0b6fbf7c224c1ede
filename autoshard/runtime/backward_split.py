"""A stage's backward in two halves: B, the gradients of the stage's inputs (what the previous
stage waits for), and W, the gradients of its parameters (free to run later: Qi et al. 2023).

    work = backward_input(outputs, output_grads, inputs, params)   # B: returns the input gradients
    ...                                                            # other actions
    backward_weight(work)                                          # W: accumulates into .grad

B runs autograd on the stage's inputs alone, with the graph kept, so the engine skips every
branch that only leads to a parameter (a linear layer's weight-gradient matmul, say). Before it
runs, each parameter's *frontier* is found in the autograd graph: the nodes where a value computed
from the parameter alone (the parameter, its transpose, its bf16 copy...) meets the activations
flowing from the inputs. B keeps the gradient arriving at each frontier node (a pre-hook). W runs
only the parameter side, each parameter's gradient computed once from exactly what B left. For the
common frontier nodes (a matmul, a linear with its bias, a norm's weight, an embedding: the table
WEIGHT_GRADS) W computes the parameter side's gradient itself, from what the node saved and the
gradient B captured, by autograd's own formula, and the engine only runs the short chains from there
to `.grad`; any other node is run again by the engine, from B's gradients, on its parameter side.
Parameters whose frontiers are linked (a weight used twice in one stage, one use feeding the other)
share one W call in which the saved gradients replace what would flow between the frontier nodes,
so nothing is counted twice. A stage output computed from parameters alone (the first stage's,
which has no inputs) is a frontier of its own, started from its received gradient. The first stage
has no input that needs a gradient: the runtime taps the outputs of its first ops that read both
the batch and a weight (an embedding, a first matmul: runtime/stage_actions.py's ChunkParams) and
passes them as its inputs, so its B runs down to them and its W does the rest. A stage with no input needing a gradient at all has nothing
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
from typing import Callable

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
    weight_edges: dict[Node, list[int]] = field(default_factory=dict)   # each frontier node's edges to the parameter side

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
    found: list[tuple[torch.Tensor, dict[Node, list[int]], set[Edge]]] = []
    for p in params:
        node = _node_of(p)
        if node is None or node not in users:
            continue                           # not read by this stage
        reached, met = _upward([node], users, from_inputs)
        seeds = {e for e in seed_grads if e[0] in reached}
        if met or seeds:
            found.append((p, {f: [k for k, (nxt, _) in enumerate(f.next_functions) if nxt in reached] for f in met}, seeds))
            keys.append(set(met) | {n for n in reached if n in seed_nodes})
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
        for n, edges in met.items():
            g.weight_edges[n] = sorted(set(g.weight_edges.get(n, [])) | set(edges))
        g.seeds.update({e: seed_grads[e] for e in seeds})
    return sorted(merged.values(), key=lambda g: -g.order())     # as backward would meet them


# ---- the weight halves of frontier nodes, computed by W itself ----------------------------------
# Run through the engine, W's call from a frontier node walks the whole graph below it (the engine
# marks what leads to the wanted parameters before it runs anything), once per group: on a Llama
# stage that cost more than the weight matmuls it runs. For the nodes below, W computes the
# parameter side's gradient from what the node saved in the forward and the gradient B captured at
# it, by autograd's own formula (the same bits: the mm rules follow its column-major branch), and
# hands them to the engine, W_BATCH_BYTES at a time, which runs only the parameter-side chains (a
# transpose, a bf16 cast, sp's f on a norm weight) into `.grad`. WEIGHT_GRADS: node name -> (node,
# its gradient, edge) -> the gradient for that edge, or None when the node's state is not one the
# formula covers.


def _fit(d: torch.Tensor, node: Node, k: int) -> torch.Tensor:
    """What the engine does to a node's output before passing it down edge k (validate_outputs): summed
    to the shape and cast to the dtype the next node takes (a broadcast bias or norm weight)."""
    nxt, nr = node.next_functions[k]
    meta = nxt._input_metadata[nr]
    if tuple(d.shape) != tuple(meta.shape):
        d = d.sum_to_size(meta.shape)
    return d if d.dtype == meta.dtype else d.to(meta.dtype)


def _scaled(t: torch.Tensor, alpha) -> torch.Tensor:
    return t if alpha == 1 else t * alpha


def _column_major(sizes, strides) -> bool:
    return len(sizes) == 2 and strides[0] == 1 and strides[1] == sizes[0]


def _mat1_grad(dy, mat2, sizes, strides, alpha=1):
    """autograd's mm_mat1_backward."""
    return _scaled(mat2.mm(dy.t()).t() if _column_major(sizes, strides) else dy.mm(mat2.t()), alpha)


def _mat2_grad(dy, mat1, sizes, strides, alpha=1):
    """autograd's mm_mat2_backward."""
    return _scaled(dy.t().mm(mat1).t() if _column_major(sizes, strides) else mat1.t().mm(dy), alpha)


def _mm(node: Node, dy: torch.Tensor, k: int) -> torch.Tensor | None:
    a, b = node._saved_self, node._saved_mat2
    if k == 0 and b is not None:
        return _mat1_grad(dy, b, node._saved_self_sym_sizes, node._saved_self_sym_strides)
    if k == 1 and a is not None:
        return _mat2_grad(dy, a, node._saved_mat2_sym_sizes, node._saved_mat2_sym_strides)
    return None


def _addmm(node: Node, dy: torch.Tensor, k: int) -> torch.Tensor | None:
    a, b, alpha = node._saved_mat1, node._saved_mat2, node._saved_alpha
    if k == 0:
        return _fit(_scaled(dy, node._saved_beta), node, 0)       # summed to the bias's shape
    if k == 1 and b is not None:
        return _mat1_grad(dy, b, node._saved_mat1_sym_sizes, node._saved_mat1_sym_strides, alpha)
    if k == 2 and a is not None:
        return _mat2_grad(dy, a, node._saved_mat2_sym_sizes, node._saved_mat2_sym_strides, alpha)
    return None


def _bmm(node: Node, dy: torch.Tensor, k: int) -> torch.Tensor | None:
    a, b = node._saved_self, node._saved_mat2
    if k == 0 and b is not None:
        return dy.bmm(b.transpose(1, 2))
    if k == 1 and a is not None:
        return a.transpose(1, 2).bmm(dy)
    return None


def _mul(node: Node, dy: torch.Tensor, k: int) -> torch.Tensor | None:
    other = node._saved_other if k == 0 else node._saved_self
    return _fit(dy * other, node, k) if isinstance(other, torch.Tensor) else None


def _add(node: Node, dy: torch.Tensor, k: int) -> torch.Tensor | None:
    return _fit(dy if k == 0 else _scaled(dy, node._saved_alpha), node, k)


def _sub(node: Node, dy: torch.Tensor, k: int) -> torch.Tensor | None:
    return _fit(dy if k == 0 else _scaled(-dy, node._saved_alpha), node, k)


def _layer_norm(node: Node, dy: torch.Tensor, k: int) -> torch.Tensor | None:
    if k == 0 or node._saved_weight is None:
        return None
    got = torch.ops.aten.native_layer_norm_backward(
        dy, node._saved_input, node._saved_normalized_shape, node._saved_result1, node._saved_result2,
        node._saved_weight, node._saved_bias, [False, k == 1, k == 2])
    return got[k]


def _embedding(node: Node, dy: torch.Tensor, k: int) -> torch.Tensor | None:
    if k != 0 or node._saved_sparse:
        return None
    pad = node._saved_padding_idx                # saved unsigned: -1 (none) reads as 2**64 - 1
    return torch.ops.aten.embedding_backward(dy, node._saved_indices, node._saved_weight_sym_argsize_0,
                                             pad - 2 ** 64 if pad >= 2 ** 63 else pad,
                                             node._saved_scale_grad_by_freq, False)


# Weight gradients W computes before handing them to the engine. One engine call per group cost
# more than the short chains it runs; one per stage held every weight's gradient at once, past what
# planning/memory_model.py predicts for a zero-bubble rank (the zbv test in test_memory_prediction).
W_BATCH_BYTES = 2 ** 20

WEIGHT_GRADS: dict[str, Callable[[Node, torch.Tensor, int], torch.Tensor | None]] = {
    "MmBackward0": _mm,
    "AddmmBackward0": _addmm,
    "BmmBackward0": _bmm,
    "MulBackward0": _mul,
    "AddBackward0": _add,
    "SubBackward0": _sub,
    "NativeLayerNormBackward0": _layer_norm,
    "EmbeddingBackward0": _embedding,
}


def _direct(g: _Group) -> list[tuple[GradientEdge, torch.Tensor]] | None:
    """The parameter-side edges of `g`'s frontier with their gradients, computed by WEIGHT_GRADS;
    None when a node is not in the table: the group then runs in the engine. Outputs computed from
    parameters alone (seeds) start parameter-side chains of their own and join the edges as they are."""
    out = [(GradientEdge(node, nr), x) for (node, nr), x in g.seeds.items()]
    for node in g.frontier:
        got = g.grads.get(node)
        if not got:
            continue                            # no gradient reached it
        rule = WEIGHT_GRADS.get(node.name())
        if rule is None or len(got) != 1 or got[0] is None or got[0].is_complex() \
                or got[0].layout != torch.strided:
            return None
        for k in g.weight_edges.get(node, ()):
            d = rule(node, got[0], k)
            if d is None:
                return None
            out.append((GradientEdge(*node.next_functions[k]), d))
    return out


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
    (the groups partition the parameters; the engine call a group's gradients go to accumulates
    them, as a whole backward would, without a copy)."""
    if work.done:
        torch.autograd.backward([p for p, _ in work.done], [d for _, d in work.done])
    # The groups W computes itself go to the engine together, W_BATCH_BYTES at a time.
    edges: list[tuple[GradientEdge, torch.Tensor]] = []
    params: list[torch.Tensor] = []
    held = 0                                     # bytes of the gradients in `edges`

    def flush() -> None:
        nonlocal held
        if edges:
            torch.autograd.backward([e for e, _ in edges], [d for _, d in edges], retain_graph=True, inputs=params)
        edges.clear()
        params.clear()
        held = 0
    for g in work.groups:
        got = _direct(g)
        if got is None:
            flush()                              # in the order a whole backward meets them
            _through_engine(g)
            continue
        edges += got
        params += g.params
        held += sum(d.numel() * d.element_size() for _, d in got)
        if held >= W_BATCH_BYTES:
            flush()
    flush()
    work.groups.clear()
    work.done.clear()


def _through_engine(g: _Group) -> None:
    """A group W cannot compute itself: the engine runs its frontier nodes again from B's gradients."""
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
        return
    # linked frontier nodes: what flows between them in W was already counted in B's capture
    clamps = [node.register_prehook(lambda _, saved=g.grads[node]: saved)
              for node in g.frontier if node in g.grads] if len(g.frontier) > 1 else []
    try:
        torch.autograd.backward(edges, seeds, retain_graph=True, inputs=g.params)
    finally:
        for h in clamps:
            h.remove()
