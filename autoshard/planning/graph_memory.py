"""Memory per rank read off the rank's own program: what `memory_model.py`'s GPT table guesses, taken
from the graphs the rank runs.

    mem = rank_memory_of(prog, pp_rank=0)              # a RankMemory, for any model autoshard compiled
    mem.peak, mem.explain()
    [m.peak for m in program_memory(prog)]             # every pipeline rank

The rank's program is copied onto meta tensors (planning/meta_rank.py) and its step is run there:
the runtime's own action loop over its own stage graphs in its schedule's order
(planning/meta_step.py), so the activations are the tensors autograd really saves, with their
dtypes and shapes, under whatever recomputation, sequence parallelism, tensor or expert
parallelism and schedule the program was compiled with, and the transient peak inside a backward is
whatever the ops really make. Around the step, what the rank holds between steps is counted from its
parameters as the runtime lays them out:

    weights           this rank's parameters and buffers (those its stages read), in their dtypes
    gradients         the gradient buffer: each part's flat layout (runtime/grad_buffer.py's
                      plan_layout, padded per bucket), in fp32 for 16-bit weights
    optimizer state   `moments` fp32 tensors per trainable element (AdamW: 2) and a step count per
                      tensor; with the distributed optimizer 1/dp of them (experts' 1/(dp/ep)), with
                      fp32 main weights beside 16-bit ones
    optimizer step    two temporaries of the largest tensor it steps (torch's AdamW: the second
                      moment's root, then its quotient)

Nothing here reads a configuration's fields or assumes a layer's shape: any model the compiler
accepts gets its own numbers. A mixture-of-experts layer routes by value, which a meta tensor
has not: its tokens are spread evenly over the experts (planning/graph_memory_moe.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.utils._pytree as pytree

from autoshard.planning.meta_rank import meta_rank
from autoshard.module_paths import fetch_attr
from autoshard.planning.memory_model import RankMemory
from autoshard.planning.meta_step import StepBytes, step_bytes
from autoshard.runtime.grad_buffer import plan_layout
from autoshard.runtime.gradients import main_dtype
from autoshard.runtime.schedules import stage_index

__all__ = ["RankWalk", "memory_of", "rank_memory_of", "program_memory", "state_bytes", "walk"]

_BUCKET_BYTES = 25 * 2 ** 20      # MeshRuntime.shard_gradients' default


def _held_tensors(rank, prog, graphs: list, pp_rank: int) -> dict[str, torch.Tensor]:
    """The tensors pipeline rank `pp_rank`'s stages read (MeshRuntime registers exactly these)."""
    out: dict[str, torch.Tensor] = {}
    for c in range(prog.virtual):
        graph = graphs[stage_index(pp_rank, c, prog.pp, prog.placement)].graph
        for n in graph.nodes:
            if n.op == "get_attr" and n.target not in out:
                value = fetch_attr(rank, n.target)
                if isinstance(value, torch.Tensor):
                    out[n.target] = value
    return out


def _bytes(ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def state_bytes(held: dict[str, torch.Tensor], prog, distributed_optimizer: bool, moments: int = 2,
                zero: int = 1) -> tuple[int, int, int]:
    """(weights and optimizer state, gradient buffer, the optimizer step's temporaries) in bytes;
    `zero` 2 divides the gradient buffer over the data-parallel ranks too, 3 the trainable weights."""
    dims = prog.dims
    trainable = [(n, t) for n, t in held.items() if isinstance(t, torch.nn.Parameter) and t.requires_grad]
    shared = {n for names in prog.shared_params.values() for n in names}
    parts = [([t for n, t in trainable if n not in prog.expert_params], dims.data)]
    if dims.ep > 1:
        parts.append(([t for n, t in trainable if n in prog.expert_params], dims.data // dims.ep))
    weights = _bytes({id(t): t for t in held.values()}.values())
    grads = optimizer = largest = 0
    for params, size in parts:
        if not params:
            continue
        shards = size if distributed_optimizer else 1
        tied = {i for i, t in enumerate(params) if any(held.get(n) is t for n in shared)}
        layout = plan_layout([t.numel() for t in params], shards, _BUCKET_BYTES // 4, tied)
        fp32 = torch.finfo(main_dtype(params[0].dtype)).bits // 8
        grads += layout.numel * fp32 // (shards if zero > 1 else 1)
        if zero == 3:            # only this rank's 1/shards of each trainable weight is held
            weights -= _bytes({id(t): t for t in params}.values()) - layout.numel * params[0].element_size() // shards
        elements = sum(t.numel() for t in params)
        main = 0 if params[0].dtype == torch.float32 else fp32
        optimizer += elements * (moments * 4 + main) // shards + 4 * len(params)
        largest = max(largest, -(-max(t.numel() for t in params) // shards) * 4)
    return weights + optimizer, grads, 2 * largest


def _microbatch(prog, batch: int | None, device: str | None) -> dict[str, object]:
    """One microbatch's inputs: the example inputs' shapes (a program is compiled for one
    microbatch's inputs; the runtime cuts every batch into such microbatches), with `batch`
    sequences if given, as zeros on `device` (None: the example's device)."""
    sizes = [v.shape[0] for v in pytree.tree_leaves(prog.example_inputs) if isinstance(v, torch.Tensor) and v.dim()]

    def like(v):
        if not isinstance(v, torch.Tensor):
            return v
        shape = (batch, *v.shape[1:]) if batch is not None and v.dim() and v.shape[0] == sizes[0] else v.shape
        return torch.zeros(shape, dtype=v.dtype, device=device or v.device)
    return pytree.tree_map(like, prog.example_inputs)


def _compiled_for(rank, named: dict[str, object]) -> None:
    """Compile the training graph for `named` into the program (once: later calls find it), so the
    meta copy has it."""
    was = rank.training
    rank.train(True)
    try:
        rank.graph_for((), named)
    finally:
        rank.train(was)


@dataclass(frozen=True)
class RankWalk:
    """One mesh rank's step run on meta tensors (`walk`): the tensors its stages read and what the
    step allocated and did, action by action."""
    held: dict[str, torch.Tensor]
    step: StepBytes


def walk(prog, pp_rank: int = 0, *, tp_rank: int = 0, data_rank: int = 0, batch: int | None = None,
         device: torch.device | str | None = None) -> RankWalk:
    """Run the training step of the mesh rank at (`pp_rank`, `data_rank`, `tp_rank`) on meta tensors
    (`rank_memory_of`'s arguments)."""
    if not 0 <= pp_rank < prog.pp:
        raise IndexError(f"pp_rank {pp_rank} out of range for pp={prog.pp}")
    dims = prog.dims
    ep_rank = dims.ep_rank(data_rank) if dims.ep > 1 else None
    cp_rank = data_rank % dims.cp if dims.cp > 1 else None
    _compiled_for(prog.rank(tp_rank, ep_rank=ep_rank, cp_rank=cp_rank), _microbatch(prog, batch, None))
    rank = meta_rank(prog, tp_rank, ep_rank=ep_rank, cp_rank=cp_rank,
                     device=torch.device(device) if device is not None else None)
    rank.train(True)
    gm, flat, out_spec = rank.graph_for((), _microbatch(prog, batch, "meta"))
    graphs = prog.stage_graphs(gm, cache=False)
    return RankWalk(_held_tensors(rank, prog, graphs, pp_rank),
                    step_bytes(rank, prog, pp_rank=pp_rank, graphs=graphs, flat=flat, out_spec=out_spec))


def rank_memory_of(prog, pp_rank: int = 0, *, tp_rank: int = 0, data_rank: int = 0, batch: int | None = None,
                   distributed_optimizer: bool = False, moments: int = 2,
                   device: torch.device | str | None = None) -> RankMemory:
    """Peak bytes of the mesh rank at (`pp_rank`, `data_rank`, `tp_rank`) of `prog` in a training
    step, by cause (see the module doc). Each microbatch has the example inputs' shapes, or `batch`
    sequences of them (the training graph for that size compiled first if the program has none).
    `distributed_optimizer`: AdamW's state divided over the data-parallel ranks. `device`: the one
    the rank will run on, whose attention kernel is read (default: where the weights are; the CPU
    for a model on meta)."""
    run = walk(prog, pp_rank, tp_rank=tp_rank, data_rank=data_rank, batch=batch, device=device)
    return memory_of(run, prog, distributed_optimizer=distributed_optimizer, moments=moments)


def memory_of(run: RankWalk, prog, *, distributed_optimizer: bool = False, moments: int = 2) -> RankMemory:
    """A walked rank's peak, by cause: what it holds between steps and what its step added (at the
    program's `zero` 2 or 3 the distributed optimizer is implied; the walk gathered and released
    zero=3's units and made each unit's per-pass gradient as the runtime does)."""
    zero = getattr(prog, "zero", 1)
    state, grads, optimizer_step = state_bytes(run.held, prog, distributed_optimizer or zero > 1, moments, zero)
    step = run.step
    peak = state + grads + max(step.peak, optimizer_step)
    return RankMemory(state=state, gradients=grads, activations=step.held,
                      working=max(step.peak, optimizer_step) - step.held, peak=peak)


def program_memory(prog, **options) -> list[RankMemory]:
    """`rank_memory_of` for every pipeline rank (tensor-parallel rank 0, data-parallel rank 0)."""
    return [rank_memory_of(prog, r, **options) for r in range(prog.pp)]
