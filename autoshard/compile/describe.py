"""`print(prog)`: the per-parameter table, the collectives per step, fallbacks and pipeline stages."""
from __future__ import annotations

from typing import Protocol

import torch
import torch.fx as fx
from tabulate import tabulate

from autoshard.passes.sharding.annotate import ShardingPlan
from autoshard.passes.sharding.index_sets import is_partition
from autoshard.passes.stages import StageGraph
from autoshard.runtime.mesh import ParallelDims
from autoshard.runtime.schedules import Action, bubble_fraction, check, stage_owner

__all__ = ["describe"]


class Described(Protocol):
    """What the printout reads of a program (compile/program.py's ShardedProgram)."""

    tp: int
    pp: int
    dp: int
    dims: ParallelDims
    world_size: int
    virtual: int
    microbatches: int
    schedule_name: str
    schedule: list[list[Action]]
    param_shapes: dict[str, torch.Size]
    param_holders: dict[str, set[int]]
    expert_params: set[str]
    sharding: ShardingPlan
    rank0_graph: fx.Graph
    rank0_calls: list[tuple[str, str | None]]
    predicted_stage_seconds: list[float] | None
    schedule_choice: object | None      # planning/schedule_choice.py's ScheduleChoice, under schedule="auto"
    zero: int
    fp8: tuple[str, dict[str, str | None]] | None     # precision="fp8": recipe, weight -> None or why not FP8

    def stage_graphs(self, gm: fx.Graph) -> list[StageGraph]: ...


def _param_rows(prog: Described) -> list[list[object]]:
    rows = []
    for name, shape in prog.param_shapes.items():
        use = prog.sharding.params.get(name)
        where = [",".join(map(str, sorted(prog.param_holders.get(name, ()))))] if prog.pp > 1 else []
        local, kind = list(shape), "replicated"
        if use is not None:
            local[use.dim] = sum(b - a for a, b in use.layout[0])
            kind = f"{'split' if is_partition(use.layout, use.padded or shape[use.dim]) else 'shared rows'} dim {use.dim}"
        if name in prog.expert_params:
            local[0] //= prog.dims.ep
            kind = f"experts over ep={prog.dims.ep}" + ("" if use is None else f", {kind}")
        rows.append([name, tuple(shape), kind, tuple(local), *where])
    return rows


def describe(prog: Described) -> str:
    ep = prog.dims.ep
    cp = prog.dims.cp
    head = f"autoshard program: tp={prog.tp}{f' x cp={cp}' if cp > 1 else ''} x pp={prog.pp} x dp={prog.dp}" \
           f"{f' (ep={ep})' if ep > 1 else ''}, world size {prog.world_size}"
    headers = ["parameter", "full shape", "sharding", "per-rank shape"] + (["pipeline ranks"] if prog.pp > 1 else [])
    table = tabulate(_param_rows(prog), headers=headers)
    graph = prog.rank0_graph
    calls = [target for target, _ in prog.rank0_calls]
    counts = {k: sum(1 for t in calls if t.startswith(k)) for k in ("f", "g", "sync_")}
    notes = [f"collectives per rank per step: {counts['f']} f (all-reduce in backward), {counts['g']} g "
             f"(all-reduce in forward), {counts['sync_']} replica gradient syncs"]
    notes += [f"{'whole by design' if f.by_design else 'fallback'} (replicated): {', '.join(f.modules)}: {f.reason}"
              for f in prog.sharding.fallbacks]
    notes += [f"not sharded: {s}" for s in prog.sharding.skipped]
    rings = sum(1 for t in calls if t.startswith("cp_ring_"))
    gathers = sum(1 for t in calls if t.startswith("cp_gather_"))
    if cp > 1:
        notes.append(f"context parallelism: each rank holds 1/{cp} of every sequence's tokens (pieces c and "
                     f"{2 * cp - 1}-c of {2 * cp}); {rings} ring attention calls, {gathers} key/value all-gathers "
                     "per rank per step; parameters replicated over cp")
    experts = [path for _, path in prog.rank0_calls if path is not None]
    if experts:
        notes.append(f"expert parallelism: {len(experts)} experts call(s) (e.g. {experts[0]}), each "
                     f"rank of an ep group of {ep} data-parallel ranks owning 1/{ep} of the experts; per call, "
                     f"two all-to-alls forward (tokens out, results back) and two backward")
    data = prog.dims.dp * prog.dims.cp
    if prog.zero > 1 and data > 1:
        what = "gradients and optimizer state" if prog.zero == 2 else "parameters, gradients and optimizer state"
        notes.append(f"zero={prog.zero}: {what} divided over the {data} data-parallel ranks"
                     + (" (each layer's parameters all-gathered before its forward and again before its backward, "
                        "its gradients reduce-scattered after it)" if prog.zero == 3 else ""))
    if prog.fp8 is not None:
        recipe, linears = prog.fp8
        notes.append(f"fp8 ({recipe} scaling): {sum(why is None for why in linears.values())} of {len(linears)} "
                     f"linears run in float8; in the model's dtype:" + ("" if any(linears.values()) else " none"))
        notes += [f"  {name}: {why}" for name, why in linears.items() if why is not None]
    if prog.pp * prog.virtual > 1:
        timeline = check(prog.schedule, prog.virtual, prog.microbatches, placement=prog.placement)
        notes.append(f"pipeline: {prog.schedule_name} schedule, {prog.virtual} chunk(s) per rank, "
                     f"{prog.microbatches} microbatches, bubble {bubble_fraction(timeline):.3f} of ideal time")
        if prog.schedule_choice is not None:
            notes.append(f"  chosen by schedule=\"auto\": {prog.schedule_choice.explain()}")
        predicted = prog.predicted_stage_seconds
        for sg in prog.stage_graphs(graph):
            pp_rank, chunk = stage_owner(sg.index, prog.pp, prog.placement)
            time = f", predicted forward {predicted[sg.index] * 1e3:.3g} ms" if predicted else ""
            notes.append(f"  stage {sg.index} (pipeline rank {pp_rank}, chunk {chunk}): "
                         f"layers {sg.layers.start}-{sg.layers.stop - 1}{time}, receives {sg.receives or '-'}")
    return "\n".join([head, table, *notes])
