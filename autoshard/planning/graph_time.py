"""Step time read off the program's own ops: every pipeline rank's step run on meta tensors
(graph_memory.walk), each action's work timed on a hardware profile, the actions laid out by the
schedule, and the step's end added.

    t = step_time(prog, hw)                  # a StepTime: seconds and their breakdown
    t.seconds, t.breakdown

Per action (F, B or W of one stage and microbatch), from planning/op_cost.py's count of its ops:

    compute     max(matmul FLOPs / the GEMM rate + attention FLOPs / the attention rate
                    + float8 matmul FLOPs / the FP8 rate, their bytes / the memory rate)
                + the other ops' bytes / the op-bytes rate + ops x the per-op overhead
    collectives each one its group's alpha-beta time (collective_timing.py) over the link its
                group's ranks use (inside a node or across: node_links.py): an all-reduce, an
                all-gather or reduce-scatter as its own start-up and half an all-reduce's bytes
                of the larger side; an all-to-all as n - 1 messages, a ring step's send as one
    sends       to the next or previous stage: one message (across nodes where stages are)

Start-up costs per kind are the profile's (`Hardware.startup_seconds`): measured per kind on the
`cpu` profile (gloo's reduce-scatter costs about an all-reduce, its all-gather and a message about
half), else a message and an all-gather or reduce-scatter half a two-rank all-reduce's.

On a machine whose ranks share cores (the `cpu` profile's `cores`) compute is stretched by ranks /
cores. The schedule is run with those costs per stage (runtime/schedules.check) and its makespan
taken; then the gradients' reduction over the data-parallel ranks (after backward, as on gloo; a
parameter tied across stages summed first), the optimizer's step on the rank's (or, distributed,
its 1/dp of the) parameters, and the profile's fixed cost per step.

Rates: the profile's GEMM rate (`peak_tflops` x `matmul_efficiency`) and memory rate; the fused
attention kernels' rate, the per-op overhead and the op-bytes rate where the profile measured them
(`attention_tflops`, `op_overhead_s`, `op_bytes_gb_s`: autoshard/cpu_profile/__init__.py, on the same
counts), else the GEMM rate, no overhead and the memory rate.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from autoshard.planning.collective_timing import allreduce_seconds
from autoshard.planning.graph_memory import RankWalk, state_bytes, walk
from autoshard.planning.hardware import Hardware
from autoshard.planning.meta_step import ActionWork
from autoshard.planning.node_links import link_gb_s
from autoshard.planning.op_cost import OpWork
from autoshard.runtime.mesh import ParallelDims
from autoshard.runtime.schedules import check

__all__ = ["StepTime", "step_time", "work_seconds"]


@dataclass(frozen=True)
class StepTime:
    seconds: float
    breakdown: dict[str, float] = field(default_factory=dict)     # pipeline, dp_comm, optimizer, fixed


def work_seconds(work: OpWork, hw: Hardware) -> float:
    """Seconds of `work`'s ops on one rank of `hw` (see the module doc)."""
    gemm_rate = hw.peak_tflops * 1e12 * hw.matmul_efficiency
    memory_rate = hw.hbm_gb_s * 1e9 * hw.memory_efficiency
    op_rate = hw.op_bytes_gb_s * 1e9 if hw.op_bytes_gb_s else memory_rate
    attention_rate = hw.attention_tflops * 1e12 if hw.attention_tflops else gemm_rate
    # float8 matmuls at the FP8 rate; a profile without one (the CPU's) at its GEMM rate
    fp8_rate = hw.fp8_tflops * 1e12 * hw.matmul_efficiency if hw.fp8_tflops else gemm_rate
    matmul = work.matmul_flops / gemm_rate + work.attention_flops / attention_rate + work.fp8_flops / fp8_rate
    if hw.gemm_traffic:
        matmul = max(matmul, work.matmul_bytes / memory_rate)
    return matmul + work.other_bytes / op_rate + work.ops * hw.op_overhead_s


def _message_seconds(nbytes: float, link_gb_s: float, hw: Hardware) -> float:
    """One message between two ranks: a send's start-up and its bytes over the link."""
    return hw.startup_seconds("send") + nbytes / (link_gb_s * 1e9 * hw.network_efficiency)


def _collective_seconds(kind: str, nbytes: int, size: int, link: float, hw: Hardware) -> float:
    """One collective of `kind` over `size` ranks joined by `link` GB/s (node_links.py)."""
    if kind == "all_reduce":
        return allreduce_seconds(nbytes, size, link, hw)
    if kind in ("all_gather", "reduce_scatter"):      # the larger side, half an all-reduce's traffic
        larger = nbytes * (size if kind == "all_gather" else 1)
        return hw.startup_seconds(kind) + (size - 1) / size * larger / (link * 1e9 * hw.network_efficiency)
    if kind == "all_to_all":                          # n - 1 message steps, (n - 1) / n of the rows leave
        return (size - 1) * _message_seconds(nbytes / size, link, hw)
    return _message_seconds(nbytes, link, hw)         # a ring step's send


def _action_seconds(a: ActionWork, hw: Hardware, share: float, dims: ParallelDims) -> float:
    comm = sum(_collective_seconds(kind, nbytes, size, link_gb_s(hw, dims, group), hw)
               for kind, nbytes, size, group in a.collectives)
    send = _message_seconds(a.sent_bytes, link_gb_s(hw, dims, "pp"), hw) if a.sent_bytes else 0.0
    return share * work_seconds(a.work, hw) + comm + send


def step_time(prog, hw: Hardware, *, batch: int | None = None, distributed_optimizer: bool = False,
              walks: list[RankWalk] | None = None) -> StepTime:
    """Seconds of one training step of `prog` on `hw` (see the module doc), microbatches of the
    example inputs' shapes (or `batch` sequences of them). `walks`: every pipeline rank's walk
    already made (graph_memory.walk, in pipeline-rank order), read instead of walking again."""
    dims = prog.dims
    share = max(1.0, dims.world_size / hw.cores) if hw.cores else 1.0
    costs: dict[tuple[str, int], list[float]] = defaultdict(list)
    reduce = optimizer = 0.0
    for run in walks if walks is not None else [walk(prog, r, batch=batch) for r in range(prog.pp)]:
        for a in run.step.actions:
            costs[(a.kind, a.stage)].append(_action_seconds(a, hw, share, dims))
        _, grad_bytes, _ = state_bytes(run.held, prog, distributed_optimizer)
        trainable = [t for t in run.held.values() if getattr(t, "requires_grad", False)]
        shared = {id(run.held[n]) for names in prog.shared_params.values() for n in names if n in run.held}
        tied = sum(t.numel() * 4 for t in trainable if id(t) in shared)
        reduce = max(reduce, allreduce_seconds(grad_bytes, dims.data, link_gb_s(hw, dims, "dp"), hw)
                     + allreduce_seconds(tied, 2, link_gb_s(hw, dims, "shared"), hw))
        params = sum(t.numel() for t in trainable) / (dims.data if distributed_optimizer else 1)
        optimizer = max(optimizer, hw.optimizer_seconds(params, len(trainable)))
    mean = {key: sum(v) / len(v) for key, v in costs.items()}
    timeline = check(prog.schedule, prog.virtual, prog.microbatches, placement=prog.placement,
                     cost_of=lambda kind, stage: mean.get((kind, stage), 0.0))
    breakdown = {"pipeline": timeline.makespan, "dp_comm": share * reduce, "optimizer": share * optimizer,
                 "fixed": share * hw.step_overhead_s}
    return StepTime(sum(breakdown.values()), breakdown)
