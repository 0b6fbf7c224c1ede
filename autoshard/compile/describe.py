"""`print(prog)`: the per-parameter table, the collectives per step, fallbacks and pipeline stages."""
from __future__ import annotations

from typing import Protocol

import torch
import torch.fx as fx
from tabulate import tabulate

from autoshard.passes.sharding.annotate import ShardingPlan
from autoshard.passes.sharding.index_sets import is_partition
from autoshard.passes.stages import StageGraph
from autoshard.runtime.schedules import Action, bubble_fraction, check, stage_owner

__all__ = ["describe"]


class Described(Protocol):
    """What the printout reads of a program (compile/program.py's ShardedProgram)."""

    tp: int
    pp: int
    dp: int
    world_size: int
    virtual: int
    microbatches: int
    schedule_name: str
    schedule: list[list[Action]]
    param_shapes: dict[str, torch.Size]
    param_holders: dict[str, set[int]]
    sharding: ShardingPlan
    rank0_graph: fx.Graph

    def stage_graphs(self, gm: fx.Graph) -> list[StageGraph]: ...


def _param_rows(prog: Described) -> list[list[object]]:
    rows = []
    for name, shape in prog.param_shapes.items():
        use = prog.sharding.params.get(name)
        where = [",".join(map(str, sorted(prog.param_holders.get(name, ()))))] if prog.pp > 1 else []
        if use is None:
            rows.append([name, tuple(shape), "replicated", tuple(shape), *where])
            continue
        local = list(shape)
        local[use.dim] = sum(b - a for a, b in use.layout[0])
        kind = "split" if is_partition(use.layout, use.padded or shape[use.dim]) else "shared rows"
        rows.append([name, tuple(shape), f"{kind} dim {use.dim}", tuple(local), *where])
    return rows


def describe(prog: Described) -> str:
    head = f"autoshard program: tp={prog.tp} x pp={prog.pp} x dp={prog.dp}, world size {prog.world_size}"
    headers = ["parameter", "full shape", "sharding", "per-rank shape"] + (["pipeline ranks"] if prog.pp > 1 else [])
    table = tabulate(_param_rows(prog), headers=headers)
    graph = prog.rank0_graph
    counts = {k: sum(1 for n in graph.nodes if n.op == "call_module" and n.target.startswith(k))
              for k in ("f", "g", "sync_")}
    notes = [f"collectives per rank per step: {counts['f']} f (all-reduce in backward), {counts['g']} g "
             f"(all-reduce in forward), {counts['sync_']} replica gradient syncs"]
    notes += [f"fallback (replicated): {', '.join(f.modules)}: {f.reason}" for f in prog.sharding.fallbacks]
    notes += [f"not sharded: {s}" for s in prog.sharding.skipped]
    if prog.pp * prog.virtual > 1:
        timeline = check(prog.schedule, prog.virtual, prog.microbatches)
        notes.append(f"pipeline: {prog.schedule_name} schedule, {prog.virtual} chunk(s) per rank, "
                     f"{prog.microbatches} microbatches, bubble {bubble_fraction(timeline):.3f} of ideal time")
        for sg in prog.stage_graphs(graph):
            pp_rank, chunk = stage_owner(sg.index, prog.pp)
            notes.append(f"  stage {sg.index} (pipeline rank {pp_rank}, chunk {chunk}): "
                         f"layers {sg.layers.start}-{sg.layers.stop - 1}, receives {sg.receives or '-'}")
    return "\n".join([head, table, *notes])
