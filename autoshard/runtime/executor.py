"""The executor: one process's part of a tp x pp x dp training step.

`MeshRuntime` holds this rank's chunks (one stage graph each, `virtual` of them with interleaving
or a V schedule, placed as the schedule says) and runs its schedule's action list
(runtime/stage_actions.py: forwards, backwards and, in zero-bubble schedules, weight-gradient
passes). Backward adds each gradient into the runtime's gradient buffers (gradients.py), which
reduce, check and clip them once the schedule ends. Each action's start and end are recorded for
tracing.
"""
from __future__ import annotations

import contextlib
import time
from typing import Callable, Protocol

import torch
import torch.fx as fx
from torch import nn

from autoshard.errors import ShardingError
from autoshard.module_paths import assign_attr, fetch_attr, has_attr
from autoshard.parallel.ring_steps import RingStep, recording
from autoshard.passes.stages import StageGraph
from autoshard.passes.unit_gathers import param_units
from autoshard.runtime.batching import TARGETS, check_loss_options, pick_loss, refuse_num_items, split_batch
from autoshard.runtime.gradients import Gradients, main_dtype, refuse_changed
from autoshard.runtime.loss_tokens import loss_factors, loss_tokens_of
from autoshard.runtime.mesh import MeshGroups, ParallelDims
from autoshard.runtime.p2p import Transfer
from autoshard.runtime.rank_binding import bound_rank_program
from autoshard.runtime.schedules import Action, splits_backward, stage_index, stage_owner
from autoshard.runtime.stage_actions import ChunkParams, build_chunk, receive_order, run_actions
from autoshard.runtime.trace import REDUCE, ActionRecord, ring_records

__all__ = ["MeshRuntime", "ProgramView", "RankView"]


class RankView(Protocol):
    """What the runtime uses of one tensor-parallel rank's program (compile/rank.py's RankProgram)."""

    training: bool
    expert_group: object | None
    expert_params: set[str]

    def bind(self, comm: object) -> "RankView": ...
    def bind_inputs(self, args: tuple, kwargs: dict) -> dict[str, object]: ...
    def graph_for(self, args: tuple, kwargs: dict) -> tuple[fx.GraphModule, list, object]: ...
    def graph_modules(self) -> list[fx.GraphModule]: ...
    def set_tensors(self, values: dict[str, torch.Tensor]) -> None: ...
    def expert_calls(self) -> list: ...
    def bind_experts(self, group: object) -> None: ...
    def bind_context(self, group: object) -> None: ...
    def named_parameters(self): ...
    def train(self, mode: bool = True) -> nn.Module: ...


class ProgramView(Protocol):
    """What the runtime uses of a compiled program (compile/program.py's ShardedProgram)."""

    dims: ParallelDims
    virtual: int
    microbatches: int
    placement: str
    example_inputs: dict[str, object]
    shared_params: dict[tuple[int, ...], list[str]]
    experts_per_rank: int | None

    def rank(self, r: int, ep_rank: int | None = None, cp_rank: int | None = None, *, copy: int = 0) -> RankView: ...
    def stage_graphs(self, gm: fx.GraphModule) -> list[StageGraph]: ...
    def param_weight(self, name: str, tp_rank: int) -> torch.Tensor | float: ...


class MeshRuntime(nn.Module):
    """This process's part of a tp x pp x dp program: its chunks (one stage each; all of the model
    without pipelining), its groups and its schedule; see `ShardedProgram.distributed`.

    `named_parameters()` lists only the parameters this rank holds, under the model's names; give
    them to any torch.optim optimizer.
    """

    def __init__(self, prog: ProgramView, rank: int, groups: MeshGroups, schedule: list[list[Action]], *,
                 program: RankView | None = None):
        super().__init__()
        self.dims: ParallelDims = prog.dims
        self.global_rank = rank
        self.pp_rank, self.dp_rank, self.tp_rank = self.dims.coords(rank)
        self.groups, self.virtual, self.microbatches = groups, prog.virtual, prog.microbatches
        self.n_stages = self.dims.pp * self.virtual
        self.placement = prog.placement
        self.actions = schedule[self.pp_rank]
        self.split = splits_backward(schedule)      # B and W apart (runtime/backward_split.py)
        self.records: list[ActionRecord] = []
        self.last_grad_norm: torch.Tensor | None = None
        self.grads: Gradients | None = None     # built at the first step, or sharded by a DistributedOptimizer
        self.unit_gathers = None      # fully sharded parameters (runtime/sharded_params.py), set by the optimizer
        self.zero = getattr(prog, "zero", 1)      # DistributedOptimizer's default stage
        self._origin = 0.0            # when the current step began (time.time()): records count from it
        self._prog = prog
        # `program`: a rank program given whole (the planner's meta copy of one, walked in a ShapeWorld)
        if program is None:
            program = bound_rank_program(prog, groups, self.dp_rank, self.tp_rank)
        self.expert_group = program.expert_group      # ep > 1: its group, experts per rank, bytes sent
        self.expert_params = set(program.expert_params)
        # not a submodule: this runtime registers the tensors its chunks read itself (below)
        object.__setattr__(self, "_program", program)
        self._chunks: dict[int, list[tuple[StageGraph, fx.GraphModule, ChunkParams]]] = {}   # id(rank graph) -> chunks
        self.training = program.training
        gm, _, _ = program.graph_for((), prog.example_inputs)
        for _, chunk, _ in self._chunks_for(gm):     # the tensors its stages read: parameters and buffers
            for n in chunk.graph.nodes:
                value = fetch_attr(chunk, n.target) if n.op == "get_attr" else None
                if isinstance(value, torch.Tensor) and not has_attr(self, n.target):
                    assign_attr(self, n.target, value)
        self.device = next(self.parameters()).device      # NCCL sends and reduces device tensors
        self.expert_params &= {name for name, _ in self.named_parameters()}     # those of this rank's stages
        self.transfer = Transfer(self.n_stages, self.device, rank, groups.world)
        self.transfer.ahead = groups.world.backend in ("gloo", "local", "shapes")    # runtime/p2p.py

    def train(self, mode: bool = True) -> "MeshRuntime":
        """Training or evaluation mode, for this runtime and its rank program's graphs."""
        super().train(mode)
        self._program.train(mode)
        return self

    # ---- building ----------------------------------------------------------------------------
    def _chunks_for(self, gm: fx.GraphModule) -> list[tuple[StageGraph, fx.GraphModule, ChunkParams]]:
        if id(gm) not in self._chunks:
            stages = self._prog.stage_graphs(gm)
            mine = [stages[stage_index(self.pp_rank, c, self.dims.pp, self.placement)] for c in range(self.virtual)]
            self._chunks[id(gm)] = [build_chunk(self._program, sg, self.split, self.unit_gathers) for sg in mine]
        return self._chunks[id(gm)]

    def param_units(self, chunks: list | None = None) -> list[list[str]]:
        """This rank's trainable parameters grouped into the units fully sharded data parallelism
        gathers one at a time (passes/unit_gathers.py), in the order its chunks (default: those of
        the example inputs' graph) read them."""
        if chunks is None:
            chunks = self._chunks_for(self._program.graph_for((), self._prog.example_inputs)[0])
        trainable = {n for n, p in self.named_parameters() if p.requires_grad}
        units: list[list[str]] = []
        seen: set[str] = set()
        for sg, _, params in chunks:
            for unit in param_units(sg.graph, [n for n in params.names if n in trainable and n not in seen]):
                units.append(unit)
                seen.update(unit)
        return units

    def use_unit_gathers(self, gathers) -> None:
        """Gather parameters unit by unit from now on (a DistributedOptimizer at zero=3): the chunks are
        built again with the gather calls in their graphs."""
        if self.split:
            raise ShardingError("fully sharded parameters (zero=3) with a zero-bubble schedule are not built: W, "
                                "run after B, would need each unit gathered from B until W; use schedule='1f1b' or "
                                "'interleaved'")
        self.unit_gathers = gathers
        self._chunks = {}

    def stage_of(self, action: Action) -> int:
        return action.stage(self.pp_rank, self.dims.pp, self.placement)

    def rank_of_stage(self, stage: int) -> int:
        """The global rank running `stage` in this rank's data- and tensor-parallel position."""
        return self.dims.rank_of(stage_owner(stage, self.dims.pp, self.placement)[0], self.dp_rank, self.tp_rank)

    def _chunk_modules(self) -> list[fx.GraphModule]:
        return [gm for chunks in self._chunks.values() for _, gm, _ in chunks]

    def graph_modules(self) -> list[fx.GraphModule]:
        return self._chunk_modules() + self._program.graph_modules()

    def expert_calls(self) -> list:
        """The expert-parallel calls this rank's stages run (regions/experts_call.py's ExpertsCall)."""
        mine = dict(self.named_parameters())
        return [c for c in self._program.expert_calls() if set(c.region.params) <= set(mine)]

    def set_tensors(self, values: dict[str, torch.Tensor]) -> None:
        """Replace parameters or buffers by name in this runtime, its chunks and its rank program."""
        for name, value in values.items():
            for root in [self] + self._chunk_modules():
                if has_attr(root, name):
                    assign_attr(root, name, value)
        self._program.set_tensors(values)
        self.device = self.transfer.device = next(self.parameters()).device

    # ---- one step ----------------------------------------------------------------------------
    @property
    def rank_program(self):
        """This process's rank program: the graphs its stages were cut from (what a caller reads a
        signature's graph off, `graph_for`)."""
        return self._program

    def train_step(self, *args, max_norm: float | None = None,
                   loss_fn: Callable[[object, object], torch.Tensor] | None = None, targets: object = None,
                   loss_reduction: str = "mean", ignore_index: int = -100, local_batch: bool = False,
                   **kwargs) -> torch.Tensor:
        """Forward and backward of one global batch (every rank passes the same batch; data-parallel
        rank d trains on its d-th slice, cut into microbatches; with `local_batch` each rank passes
        its data-parallel replica's slice itself, so no rank holds the global batch); gradients are accumulated into
        `.grad`, synchronised, and clipped to `max_norm` if given. Returns the batch's loss on
        every rank. Call your optimizer's `step()` after it.

        The loss is the model's own (`.loss`, or its one scalar output), or `loss_fn(outputs,
        targets)` on the last stage, with `targets` (tensors batched like the inputs) cut into the
        same microbatches. A model whose loss is a mean cross-entropy (Hugging Face's, F.cross_entropy)
        is averaged per token over the whole global batch, as on one device: microbatch i's mean
        counts n_i / N, n_i its tokens whose label is not ignored, N their sum over all microbatches
        and data-parallel ranks. `loss_fn` declares its normalization with `loss_reduction`: "sum"
        (it returns the sum over its tokens; the step divides by the global count of targets not
        equal to `ignore_index`, so the result is the per-token mean) or "mean" (a mean over the
        microbatch's samples; the step averages the microbatches' means, which equals the per-token
        mean only when every microbatch counts the same tokens). Any other loss of the model is
        averaged over microbatches the same way."""
        check_loss_options(loss_fn is not None, loss_reduction, self.dims.cp)
        if loss_fn is None and targets is not None:     # the model's own input (nanoGPT's `targets`)
            kwargs["targets"] = targets
        named = self._program.bind_inputs(args, kwargs)
        refuse_num_items(named)
        if loss_fn is not None:
            named = {**named, TARGETS: targets}
        # the cp ranks of a replica read the same sequences (each graph cuts its own tokens)
        mine = named if local_batch else split_batch(named, self.dims.dp, "dp")[self.dp_rank // self.dims.cp]
        micro = split_batch(mine, self.microbatches, "microbatches")
        goals = [mb.pop(TARGETS, None) for mb in micro]

        def loss_of(outputs: object, i: int) -> torch.Tensor:
            return loss_fn(outputs, goals[i]) if loss_fn is not None else pick_loss(outputs)
        flats = []
        for mb in micro:
            gm, flat, out_spec = self._program.graph_for((), mb)
            flats.append(flat)
        scales, per_token = self._loss_scales(gm, flats, goals, loss_fn, loss_reduction, ignore_index)
        chunks = self._chunks_for(gm)
        self._origin = time.time()
        grads = self._gradients()
        gain = grads.loss_scale                      # fp16: the loss is scaled for backward
        scales = [s * gain for s in scales]
        # per token, the loss factors already sum to one over the dp ranks; else each rank's sum to one
        averaged_over = 1 if per_token else self.dims.data
        uses: dict[str, int] = {}         # a V schedule's rank reads a tied embedding in two chunks
        for _, _, params in chunks:
            for name in params.names:
                uses[name] = uses.get(name, 0) + 1
        grads.begin(self.microbatches, 1.0 / averaged_over / gain, self._origin, uses)
        ring: list[RingStep] = []
        self.transfer.expect(receive_order(self))
        with recording(ring) if self.dims.cp > 1 else contextlib.nullcontext():
            losses = run_actions(self, chunks, flats, out_spec, loss_of, scales)
        self.transfer.wait_sends()
        self.records += ring_records(ring, self.global_rank, self.pp_rank, self._origin)
        self.last_grad_norm = grads.end(max_norm)
        self.records += [ActionRecord(self.global_rank, self.pp_rank, -1, Action(REDUCE, 0, k), r.launched, r.done)
                         for k, r in grads.records()]
        # every rank reduces in one dtype: the main weights' (an fp64 model's loss stays fp64)
        total = torch.zeros((), dtype=main_dtype(next(self.parameters()).dtype), device=self.device)
        if losses and self.tp_rank == 0:           # the ranks holding the last stage
            total = (torch.stack(losses).sum() / averaged_over / gain).to(total.dtype)
        self.groups.world.all_reduce(total)          # the last stages' parts, on every rank
        return total

    def _loss_scales(self, gm: fx.GraphModule, flats: list[list], goals: list, loss_fn, reduction: str,
                     ignore_index: int) -> tuple[list[torch.Tensor | float], bool]:
        """Each microbatch's loss factor, and whether they average per token (loss_tokens.py)."""
        counter = loss_tokens_of(gm) if loss_fn is None else None
        return loss_factors(counter, flats, goals, loss_fn is not None, reduction, ignore_index,
                            self.groups.dp if self.dims.data > 1 else None, self.device)

    # ---- gradients ---------------------------------------------------------------------------
    def _gradients(self) -> Gradients:
        """The gradient buffers for the parameters as they are now: rebuilt (unsharded) when the
        trainable parameters changed since the last step; a sharded one cannot be."""
        trainable = [(n, p) for n, p in self.named_parameters() if p.requires_grad]
        if self.grads is not None and not self.grads.matches(trainable):
            if self.grads.sharded:
                refuse_changed(trainable, self.grads)
            self.grads.remove_hooks()
            self.grads = None
        return self.grads or self.shard_gradients(shard=False)

    def shard_gradients(self, *, shard: bool = True, bucket_bytes: int = 25 * 2 ** 20,
                        overlap: bool | None = None, units: list[list[str]] | None = None) -> Gradients:
        """Lay the trainable parameters' gradients out anew: each part reduce-scattered over its group
        for a distributed optimizer (all-reduced with shard=False) in buckets of `bucket_bytes`;
        `overlap` starts each bucket's reduction inside backward (default: on, except on gloo);
        `units` (param_units()): one bucket per unit, reduce-scattered after every backward pass and
        held 1/dp (zero=2 and 3)."""
        if self.grads is not None:
            self.grads.remove_hooks()
        tied = {n: group for pps, group in self.groups.shared.items() for n in self._prog.shared_params.get(pps, [])}
        self.grads = Gradients([(n, p) for n, p in self.named_parameters() if p.requires_grad], self.groups,
                               tied=tied, experts=self.expert_params, shard=shard, bucket_bytes=bucket_bytes,
                               overlap=overlap, units=units,
                               weight_of=lambda name: self._prog.param_weight(name, self.tp_rank))
        return self.grads

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip the last step's reduced gradients by the global norm over all tp x pp x dp ranks
        (train_step's `max_norm` does it too); returns the norm."""
        if self.grads is None:
            raise ShardingError("clip_grad_norm_: no train_step has run, there are no gradients to clip")
        return self.grads.clip(max_norm)
