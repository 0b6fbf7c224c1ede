"""One pipeline rank's training step run on meta tensors: the runtime itself (a `MeshRuntime` over
the rank's meta copy, its `Transfer` and action loop, runtime/stage_actions.py's `run_actions`)
over the rank's own stage graphs, in its schedule's order, in a ShapeWorld (world/shapes.py): the
rank runs alone, a receive's buffer is shaped by its receiver and a header is answered with the
shapes the sending stage makes.

    gm, flat, out_spec = rank.graph_for((), meta_inputs)
    bytes = step_bytes(rank, prog, pp_rank=1, graphs=prog.stage_graphs(gm), flat=flat, out_spec=out_spec)
    bytes.peak, bytes.held

Everything the rank allocates in a step is allocated here as it is there: the saved activations of
every microbatch in flight (F to B, or to W in a zero-bubble schedule), the receive buffers, the
sends kept until the step's end, the input gradients sent back, the gradient a parameter's
backward makes before the gradient buffer takes it (runtime/grad_buffer.py adds it into its slice
and drops it: so does the hook here), the logits and loss of the last stage and whatever an op
makes and frees inside a layer's backward. `LiveBytes` counts them as they come and go.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from autoshard.errors import ShardingError
from autoshard.planning.live_bytes import LiveBytes
from autoshard.planning.op_cost import OpCost, OpWork
from autoshard.runtime.batching import pick_loss
from autoshard.runtime.executor import MeshRuntime
from autoshard.runtime.mesh import MeshGroups
from autoshard.runtime.p2p import FORWARD, header, read_tag
from autoshard.runtime.schedules import splits_backward, stage_index
from autoshard.runtime.sharded_params import ShardedParams, UnitGathers
from autoshard.runtime.stage_actions import build_chunk, receive_order, run_actions
from autoshard.world import P2P
from autoshard.world.shapes import ShapeWorld

__all__ = ["ActionWork", "StepBytes", "step_bytes"]


@dataclass(frozen=True)
class ActionWork:
    """What one action of the step did: its ops' work, its collectives (kind, bytes, group size, the
    group's kind in the mesh) and the bytes it sent to other pipeline ranks."""
    kind: str
    stage: int
    microbatch: int
    work: OpWork
    collectives: tuple[tuple[str, int, int, str], ...]
    sent_bytes: int


@dataclass(frozen=True)
class StepBytes:
    """Bytes one rank's step allocates beyond what it holds between steps, and each action's work."""
    peak: int        # the most live at once
    held: int        # the most live between two actions (activations kept for backward, mostly)
    actions: tuple[ActionWork, ...] = ()


def _stage_inputs(stages: list[fx.GraphModule], flat: list) -> dict[int, list[tuple[torch.Size, torch.dtype]]]:
    """Each stage's received values (the previous stage's outputs), from one forward of every stage."""
    shapes, received = {}, []
    with torch.no_grad():
        for s, gm in enumerate(stages):
            outs = list(gm(*flat, *received))
            shapes[s + 1] = [(t.shape, t.dtype) for t in outs if isinstance(t, torch.Tensor)]
            received = outs
    return shapes


def step_bytes(rank, prog, *, pp_rank: int, graphs: list, flat: list, out_spec) -> StepBytes:
    """Run pipeline rank `pp_rank`'s actions of `prog`'s schedule for one step of `rank` (a meta
    rank program: planning/meta_rank.py) whose graph for the step's inputs is cut into `graphs`
    (prog.stage_graphs), every microbatch `flat` (that graph's inputs, on meta; `out_spec` its
    outputs' structure), and count what it allocates."""
    microbatches = [flat] * prog.microbatches
    pp, placement, n_stages = prog.pp, prog.placement, prog.pp * prog.virtual
    split = splits_backward(prog.schedule)
    every = [fx.GraphModule(rank, sg.graph, class_name=f"Stage{sg.index}") for sg in graphs]
    with _grouped_mm_on_meta():
        inputs_of = _stage_inputs(every, microbatches[0])
    me = prog.dims.rank_of(pp_rank, 0, rank.handle.rank)
    world = ShapeWorld(prog.dims.world_size, me, answer=lambda op: _answer(op, inputs_of, n_stages))
    rt = MeshRuntime(prog, me, MeshGroups(prog.dims, me, list(prog.shared_params), world), prog.schedule,
                     program=rank)
    mine = [graphs[stage_index(pp_rank, c, pp, placement)] for c in range(prog.virtual)]
    chunks = [build_chunk(rank, sg, split) for sg in mine]
    zero = getattr(prog, "zero", 1)
    if zero > 1:
        chunks, hooks = _sharded(rt, rank, mine, chunks, split, zero, prog.microbatches), []
    else:
        hooks = [p.register_post_accumulate_grad_hook(_drop_grad) for p in rank.parameters() if p.requires_grad]
    log = getattr(rank, "collective_log", [])
    try:
        with _grouped_mm_on_meta(), LiveBytes("meta") as live, OpCost() as cost:
            cost.take()
            del log[:]
            held, actions, seen = [0], [], [0, 0]

            def after(record) -> None:
                """Between two actions: what is held, and what the action did."""
                held[0] = max(held[0], live.live)
                a = record.action
                actions.append(ActionWork(a.kind, record.stage, a.microbatch, cost.take(), tuple(log[seen[0]:]),
                                          rt.transfer.bytes_sent - seen[1]))
                seen[:] = [len(log), rt.transfer.bytes_sent]
            rt.transfer.expect(receive_order(rt))
            losses = run_actions(rt, chunks, microbatches, out_spec, lambda outputs, i: _loss(outputs),
                                 [1.0] * len(microbatches), after=after)
            rt.transfer.wait_sends()
            del losses
            return StepBytes(live.peak, held[0], tuple(actions))
    finally:
        for h in hooks:
            h.remove()


def _sharded(rt: MeshRuntime, rank, mine: list, chunks: list, split: bool, zero: int, microbatches: int) -> list:
    """zero 2 and 3: the runtime's own per-pass gradients (each unit's full-size gradient made,
    reduce-scattered and dropped as in a real step) and at zero=3 its sharded parameters, gathered
    and released by the same calls in the chunks' graphs; made here, before the walk counts, as the
    optimizer makes them before the first step. Returns the chunks to walk."""
    units = rt.param_units(chunks)
    grads = rt.shard_gradients(shard=True, units=units)
    grads.begin(microbatches, 1.0, 0.0)
    if zero < 3:
        return chunks
    rt.unit_gathers = UnitGathers([ShardedParams(part) for part in grads.parts], units)
    return [build_chunk(rank, sg, split, rt.unit_gathers) for sg in mine]


def _answer(op: P2P, inputs_of: dict[int, list[tuple[torch.Size, torch.dtype]]], n_stages: int) -> None:
    """What the sending stage sends where a receiver reads a value: a header (slot 2i) holds the shape
    of the i-th input of the stage after the sender; a payload's buffer is shaped already."""
    stage, _, direction, slot = read_tag(op.tag, n_stages)
    if direction == FORWARD and slot % 2 == 0:
        shape, dtype = inputs_of[stage + 1][slot // 2]
        op.tensor.copy_(header(shape, dtype))


def _loss(outputs: object) -> torch.Tensor:
    """The model's loss; for a model that returns none (its loss is a train_step loss_fn's, unknown
    here), the sum of its floating outputs, whose backward makes their gradients as a loss would."""
    try:
        return pick_loss(outputs)
    except ShardingError:
        floats = [t for t in pytree.tree_leaves(outputs) if isinstance(t, torch.Tensor) and t.is_floating_point()]
        return sum(t.sum() for t in floats)


@contextlib.contextmanager
def _grouped_mm_on_meta():
    """torch's meta kernel of `F.grouped_mm` takes bf16 alone (the CUDA kernel's rule), where the CPU
    runs it in fp32 too: a model's experts calling it eagerly (expert parallelism's local experts)
    get, for the walk, one matmul of the same shapes [S, K] x [K, N] -> [S, N], which saves the
    same tensors and whose backward makes gradients of the same sizes."""
    real = torch.nn.functional.grouped_mm

    def shaped(mat_a, mat_b, *args, **kwargs):
        if mat_a.device.type != "meta":
            return real(mat_a, mat_b, *args, **kwargs)
        return mat_a @ mat_b[0]
    torch.nn.functional.grouped_mm = shaped
    try:
        yield
    finally:
        torch.nn.functional.grouped_mm = real


def _drop_grad(p: torch.nn.Parameter) -> None:
    p.grad = None
