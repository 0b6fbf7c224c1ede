"""One step of one pipeline rank: its schedule's actions run in order (MeshRuntime.train_step).

F receives its stage's inputs from the previous stage (unless it is stage 0), runs the stage graph
on the microbatch, sends the outputs on and keeps what backward needs. B receives the output
gradients (the last stage starts from its loss), back-propagates and sends its input gradients
back. In a schedule without W actions B is the whole backward and frees the microbatch; with them
B computes the input gradients only and W, later, the parameters' (runtime/backward_split.py),
then frees it; where the first stage's W comes right after its B, B is the whole backward and W
empty (`whole_backwards`). Gradients land in the runtime's gradient buffers (runtime/gradients.py) through
`.grad`, once per parameter and microbatch either way. Each action's start and end are recorded.
"""
from __future__ import annotations

import time
from typing import Callable

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from autoshard.module_paths import fetch_attr
from autoshard.passes.graph_reading import weight_values
from autoshard.passes.stages import StageGraph
from autoshard.passes.unit_gathers import insert_unit_gathers
from autoshard.runtime.backward_split import WeightWork, backward_input, backward_weight
from autoshard.runtime.gradients import main_dtype
from autoshard.runtime.p2p import BACKWARD, FORWARD, Receive
from autoshard.runtime.trace import ActionRecord

__all__ = ["ChunkParams", "build_chunk", "receive_order", "run_actions", "whole_backwards"]


_OPS = ("call_function", "call_method", "call_module")


class ChunkParams:
    """Which parameters one chunk's graph reads, and which of them are read inside a recomputed
    region (their gradients are computed in B, so the region runs once: runtime/backward_split.py).

    `tap_boundaries(graph)`, for the first stage of a zero-bubble schedule: a copy of its graph in
    which each first meeting of the batch with a weight (an op reading a value computed from the
    inputs alone and one computed from weights alone: the embedding lookup, the first matmul) hands
    its output to `self.taps` as it runs, so that B can stop there and leave the weights to W."""

    def __init__(self, graph: fx.Graph):
        self.taps: list[torch.Tensor] = []
        self.names = list(dict.fromkeys(n.target for n in graph.nodes if n.op == "get_attr"))
        weights = weight_values(graph)
        recomputed: set[str] = set()
        for n in graph.nodes:
            if n.op == "call_module" and n.meta.get("recompute"):
                stack = [a for a in n.all_input_nodes if a in weights]
                while stack:
                    a = stack.pop()
                    if a.op == "get_attr":
                        recomputed.add(a.target)
                    stack += [b for b in a.all_input_nodes if b in weights]
        self.recomputed = [name for name in self.names if name in recomputed]

    @staticmethod
    def boundaries(graph: fx.Graph) -> list[fx.Node]:
        """The first ops that read both the batch (placeholders) and the weights (get_attr)."""
        weights = weight_values(graph)
        data: set[fx.Node] = set()
        out = []
        for n in graph.nodes:
            if n.op == "placeholder" or (n.op == "call_function" and not n.all_input_nodes):
                data.add(n)                    # the batch, and constants made in the graph (an arange)
            elif n.op in _OPS and n not in weights and all(a in data or a in weights for a in n.all_input_nodes):
                if any(a in weights for a in n.all_input_nodes):
                    out.append(n)              # the batch meets a weight here
                else:
                    data.add(n)
        return out

    def tap_boundaries(self, graph: fx.Graph) -> fx.Graph:
        copy = fx.Graph()
        copy.output(copy.graph_copy(graph, {}))
        taps = self.taps

        def tap(value):
            for t in (value if isinstance(value, (tuple, list)) else (value,)):
                if isinstance(t, torch.Tensor) and t.requires_grad and t.is_floating_point():
                    taps.append(t)
            return value
        for n in self.boundaries(copy):
            with copy.inserting_after(n):
                t = copy.call_function(tap, (n,))
            n.replace_all_uses_with(t, delete_user_cb=lambda user, t=t: user is not t)
        copy.lint()
        return copy

    @staticmethod
    def tensors(gm: fx.GraphModule, names: list[str]) -> list[torch.Tensor]:
        """The trainable parameters among `names`, as `gm` reads them now (the distributed optimizer
        may have moved them)."""
        out = [fetch_attr(gm, name) for name in names]
        return [t for t in out if isinstance(t, torch.nn.Parameter) and t.requires_grad]


def build_chunk(root: torch.nn.Module, sg: StageGraph, split: bool, gathers=None
                ) -> tuple[StageGraph, fx.GraphModule, ChunkParams]:
    """One chunk as run_actions takes it: stage `sg`'s graph over `root`'s tensors and what it reads;
    in a zero-bubble schedule (`split`) the first stage's B stops where the batch meets the first
    weights (ChunkParams.tap_boundaries); with fully sharded parameters (`gathers`, a
    runtime/sharded_params.py UnitGathers) each unit is gathered around the ops that read it
    (passes/unit_gathers.py)."""
    params = ChunkParams(sg.graph)
    graph = params.tap_boundaries(sg.graph) if split and sg.index == 0 else sg.graph
    if gathers is not None:
        graph = insert_unit_gathers(graph, gathers.unit_of, gathers.acquire, gathers.release, gathers.before_backward)
    return sg, fx.GraphModule(root, graph, class_name=f"Stage{sg.index}"), params


def whole_backwards(rt) -> set[tuple[int, int]]:
    """(stage, microbatch) pairs of the first stage whose W comes right after its B in `rt`'s actions:
    no stage waits for the first stage's input gradients, and nothing runs between, so the split
    would only cost (B + W is more than one backward: runtime/backward_split.py); B runs the whole
    backward and W is empty. ZB-H1's rank 0 runs every microbatch so, ZBV's rank 0 its steady state."""
    out = set()
    for a, nxt in zip(rt.actions, rt.actions[1:]):
        if a.kind == "B" and nxt.kind == "W" and (a.chunk, a.microbatch) == (nxt.chunk, nxt.microbatch) \
                and rt.stage_of(a) == 0:
            out.add((0, a.microbatch))
    return out


def receive_order(rt) -> list[Receive]:
    """The receives from other ranks that `rt`'s actions make in one step, in order (run_actions'
    rules: an F past the first stage receives its inputs, a B before the last stage its outputs'
    gradients), for Transfer.expect."""
    order = []
    for a in rt.actions:
        stage = rt.stage_of(a)
        if a.kind == "F" and stage > 0:
            order.append(Receive(FORWARD, stage, a.microbatch, rt.rank_of_stage(stage - 1)))
        elif a.kind == "B" and stage < rt.n_stages - 1:
            order.append(Receive(BACKWARD, stage, a.microbatch, rt.rank_of_stage(stage + 1)))
    return [r for r in order if r.src != rt.global_rank]


def run_actions(rt, chunks: list[tuple[StageGraph, fx.GraphModule, ChunkParams]], flats: list[list], out_spec,
                loss_of: Callable[[object, int], torch.Tensor], scales: list,
                after: Callable[[ActionRecord], None] | None = None) -> list[torch.Tensor]:
    """Run `rt`'s (a MeshRuntime's) actions for one step; returns the last stage's scaled microbatch
    losses. A microbatch whose scale is 0 (no token counted: its mean is 0/0) adds nothing and
    back-propagates nothing. `after(record)` is called as each action ends (the planner's walk reads
    what is live between actions there)."""
    last = rt.n_stages - 1
    split = rt.split
    whole = whole_backwards(rt) if split else set()
    saved: dict[tuple[int, int], tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    pending: dict[tuple[int, int], WeightWork] = {}
    losses, origin = [], rt._origin
    rt.records = []
    for a in rt.actions:
        stage, i = rt.stage_of(a), a.microbatch
        start = time.time()
        _, gm, params = chunks[a.chunk]
        if a.kind == "F":
            received = []
            params.taps.clear()
            if stage > 0:
                received = rt.transfer.recv_forward(len(chunks[a.chunk][0].receives), rt.rank_of_stage(stage - 1),
                                                    stage, i)
                received = [t.requires_grad_() if t.is_floating_point() else t for t in received]
                start = time.time()           # waiting for the previous stage is idle time
            outs = list(gm(*flats[i], *received))
            if stage == last:
                loss = loss_of(pytree.tree_unflatten(outs, out_spec), i)
                scale = scales[i].to(loss.dtype) if isinstance(scales[i], torch.Tensor) else scales[i]
                # No token counted: the model's mean is 0/0 (NaN) and the microbatch adds nothing. At
                # ep or cp > 1 its backward still runs (it exchanges tokens or keys with the other
                # ranks), through loss * 0: the NaN gets a zero gradient, and its value is not counted.
                empty = isinstance(scale, torch.Tensor) and not bool(scale)
                outs = [torch.zeros_like(loss) if empty and rt.dims.ep == 1 and rt.dims.cp == 1 else loss * scale]
                counted = torch.zeros_like(outs[0]) if empty else outs[0]
                losses.append(counted.detach().to(rt.device, main_dtype(counted.dtype)))     # bf16: fp32; fp64 stays
            else:
                rt.transfer.send(outs, rt.rank_of_stage(stage + 1), stage, i, FORWARD)
            # the first stage of a split schedule: its taps stand for the inputs B runs down to
            saved[(stage, i)] = (outs, received if stage > 0 or not split else list(params.taps))
        elif a.kind == "B":
            outs, received = saved[(stage, i)] if split else saved.pop((stage, i))
            if stage == last:
                pairs = [(outs[0], None)] if outs[0].requires_grad else []
            else:
                sent = [o for o in outs if o.is_floating_point()]
                grads = rt.transfer.recv_backward(sent, rt.rank_of_stage(stage + 1), stage, i)
                start = time.time()
                pairs = [(o, g) for o, g in zip(sent, grads) if o.requires_grad]
            floats = [t for t in received if t.is_floating_point()]
            if split and (stage, i) in whole:
                if pairs:                      # B and W at once; its W (next) has nothing left to do
                    torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
                back, pending[(stage, i)] = [None] * len(floats), WeightWork([], [])
            elif split:
                back, pending[(stage, i)] = backward_input([o for o, _ in pairs], [g for _, g in pairs], floats,
                                                           params.tensors(gm, params.names),
                                                           params.tensors(gm, params.recomputed))
            else:
                if pairs:
                    torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
                back = [t.grad for t in floats]
            if rt.unit_gathers is not None:
                rt.unit_gathers.end_backward()
            if stage > 0:
                back = [g if g is not None else torch.zeros_like(t) for t, g in zip(floats, back)]
                rt.transfer.send(back, rt.rank_of_stage(stage - 1), stage, i, BACKWARD)
        else:
            backward_weight(pending.pop((stage, i)))
            saved.pop((stage, i))
        rt.records.append(ActionRecord(rt.global_rank, rt.pp_rank, stage, a, start - origin, time.time() - origin))
        if after is not None:
            after(rt.records[-1])
        # drop this action's tensors now: a split B's outputs hold its microbatch's whole graph, which
        # would otherwise live on until the next action of the same kind rebinds these names
        outs = received = pairs = floats = back = grads = sent = loss = None
    return losses
