"""One pipeline rank's training step run on meta tensors: the runtime's own action loop
(runtime/stage_actions.py's `run_actions`) over the rank's own stage graphs, in its schedule's
order, with the messages to other ranks replaced by tensors of their shapes.

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
from autoshard.runtime.p2p import Receive, Transfer
from autoshard.runtime.schedules import splits_backward, stage_index, stage_owner
from autoshard.runtime.stage_actions import build_chunk, receive_order, run_actions

__all__ = ["ActionWork", "StepBytes", "step_bytes"]


@dataclass(frozen=True)
class ActionWork:
    """What one action of the step did: its ops' work, its collectives (kind, bytes, group size) and
    the bytes it sent to other pipeline ranks."""
    kind: str
    stage: int
    microbatch: int
    work: OpWork
    collectives: tuple[tuple[str, int, int], ...]
    sent_bytes: int


@dataclass(frozen=True)
class StepBytes:
    """Bytes one rank's step allocates beyond what it holds between steps, and each action's work."""
    peak: int        # the most live at once
    held: int        # the most live between two actions (activations kept for backward, mostly)
    actions: tuple[ActionWork, ...] = ()


class _Transfer(Transfer):
    """runtime/p2p.py's Transfer without the other ranks: a receive's buffers are empty tensors of
    the shapes the sender's stage makes, posted when the runtime on gloo posts them (receiving ahead:
    on NCCL, which does not, a rank holds up to one receive's buffers fewer than counted here); a
    send keeps its tensors to the step's end, as the real one keeps what its in-flight sends read;
    a transfer to this rank goes through the mailbox as a copy, as there."""

    def __init__(self, me: int, n_stages: int, inputs_of: dict[int, list[tuple[torch.Size, torch.dtype]]]):
        super().__init__(n_stages, "meta", me)
        self.ahead = True
        self._inputs_of = inputs_of

    def _send_remote(self, tensors: list[torch.Tensor], dst: int, stage: int, microbatch: int, direction: int) -> None:
        kept = [t.detach().contiguous() for t in tensors]
        self._buffers += kept
        self.bytes_sent += sum(t.numel() * t.element_size() for t in kept)

    def _receive_headers(self, count: int, src: int, stage: int) -> list[tuple[list[int], torch.dtype]]:
        return [(list(shape), dtype) for shape, dtype in self._inputs_of[stage][:count]]

    def _post(self, r: Receive, shapes: list[tuple[list[int], torch.dtype]]) -> tuple[list, list[torch.Tensor]]:
        return [], [torch.empty(shape, dtype=dtype, device="meta") for shape, dtype in shapes]


class _Sampler(list):
    """run_actions appends one record after each action: the moment to read what is held between
    actions and what the action did."""

    def __init__(self, live: LiveBytes, cost: OpCost, collectives: list, transfer: "_Transfer"):
        super().__init__()
        self.live, self.cost, self.collectives, self.transfer = live, cost, collectives, transfer
        self.held, self.actions, self._seen, self._sent = 0, [], 0, 0

    def append(self, record) -> None:
        self.held = max(self.held, self.live.live)
        a = record.action
        self.actions.append(ActionWork(a.kind, record.stage, a.microbatch, self.cost.take(),
                                       tuple(self.collectives[self._seen:]), self.transfer.bytes_sent - self._sent))
        self._seen, self._sent = len(self.collectives), self.transfer.bytes_sent
        super().append(record)


class _Rank:
    """What run_actions reads of a MeshRuntime: the rank's actions, where stages live, its transfers
    and the list it records actions in (kept: run_actions starts the step by assigning a new one)."""

    device = torch.device("meta")
    _origin = 0.0

    def __init__(self, prog, pp_rank: int, split: bool, transfer: _Transfer, sampler: _Sampler):
        self.pp, self.pp_rank, self.placement, self.dims = prog.pp, pp_rank, prog.placement, prog.dims
        self.global_rank = pp_rank        # this walk's ranks are the pipeline's (rank_of_stage)
        self.n_stages = prog.pp * prog.virtual
        self.actions, self.split, self.transfer = prog.schedule[pp_rank], split, transfer
        self._sampler = sampler

    @property
    def records(self) -> _Sampler:
        return self._sampler

    @records.setter
    def records(self, value: list) -> None:
        self._sampler[:] = value

    def stage_of(self, action) -> int:
        return action.stage(self.pp_rank, self.pp, self.placement)

    def rank_of_stage(self, stage: int) -> int:
        return stage_owner(stage, self.pp, self.placement)[0]


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
    rank program: compile/meta_rank.py) whose graph for the step's inputs is cut into `graphs`
    (prog.stage_graphs), every microbatch `flat` (that graph's inputs, on meta; `out_spec` its
    outputs' structure), and count what it allocates."""
    microbatches = [flat] * prog.microbatches
    pp, placement = prog.pp, prog.placement
    split = splits_backward(prog.schedule)
    every = [fx.GraphModule(rank, sg.graph, class_name=f"Stage{sg.index}") for sg in graphs]
    with _grouped_mm_on_meta():
        inputs_of = _stage_inputs(every, microbatches[0])
    chunks = [build_chunk(rank, graphs[stage_index(pp_rank, c, pp, placement)], split) for c in range(prog.virtual)]
    hooks = [p.register_post_accumulate_grad_hook(_drop_grad) for p in rank.parameters() if p.requires_grad]
    log = getattr(rank, "collective_log", [])
    try:
        with _grouped_mm_on_meta(), LiveBytes("meta") as live, OpCost() as cost:
            transfer = _Transfer(pp_rank, prog.pp * prog.virtual, inputs_of)
            cost.take()
            del log[:]
            rt = _Rank(prog, pp_rank, split, transfer, _Sampler(live, cost, log, transfer))
            transfer.expect(receive_order(rt))
            losses = run_actions(rt, chunks, microbatches, out_spec, lambda outputs, i: _loss(outputs),
                                 [1.0] * len(microbatches))
            rt.transfer.wait_sends()
            del losses
            return StepBytes(live.peak, rt.records.held, tuple(rt.records.actions))
    finally:
        for h in hooks:
            h.remove()


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
