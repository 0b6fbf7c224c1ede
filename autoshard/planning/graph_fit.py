"""The planner's pick checked against the compiled programs: of its fastest candidate splits, the one
whose every pipeline rank fits the device and whose step is fastest, both read off the program's
own graphs (graph_memory.py, graph_time.py).

    prog = fastest_that_fits(plan(model, gpus=8, ...), hw, build=lambda chosen: compile(chosen), world_size=8)
    prog.planned, prog.planned_memory, prog.planned_seconds   # the Estimate; each pipeline rank's peak; the step

The planner ranks splits with closed forms (memory_model.py, costmodel.py: Megatron's GPT), exact
for that GPT and off for other layers (a written-out activation saves more, attention without
dropout less, an unfused op costs its own dispatch). Its first `tries` candidates are compiled and
read; the fastest by its graphs among those that fit is kept. When none fits, up to 2 x `tries`
candidates are read before the error, which lists what each needs.
"""
from __future__ import annotations

from typing import Callable

import torch

from autoshard.errors import ShardingError
from autoshard.planning.estimate import RESERVED, Estimate
from autoshard.planning.graph_memory import memory_of, walk
from autoshard.planning.graph_time import step_time
from autoshard.planning.hardware import Hardware

__all__ = ["fastest_that_fits"]


def _device_of(hw: Hardware) -> torch.device:
    """Where the planned ranks run: the CPU for a measured CPU profile, else a GPU."""
    return torch.device("cpu" if hw.name == "cpu" else "cuda")


def _split(e: Estimate) -> str:
    return (f"tp={e.tp} pp={e.pp} dp={e.dp} v={e.virtual} microbatch={e.microbatch} recompute={e.recompute}"
            + (" distributed-optimizer" if e.distributed_optimizer else ""))


def fastest_that_fits(candidates: list[Estimate], hw: Hardware, build: Callable[[Estimate], object], world_size: int,
                      tries: int = 3):
    """`build(chosen)` for the candidate the graphs say is fastest among those that fit `hw` (see the
    module doc)."""
    usable = (1 - RESERVED) * hw.memory_gib * 2 ** 30
    device = _device_of(hw)
    needed, best = [], None
    for i, chosen in enumerate(candidates[:2 * tries]):
        if i >= tries and best is not None:
            break
        prog = build(chosen)
        walks = [walk(prog, r, batch=chosen.microbatch, device=device) for r in range(prog.pp)]
        memory = [memory_of(run, prog, distributed_optimizer=chosen.distributed_optimizer) for run in walks]
        peak = max(m.peak for m in memory)
        if peak > usable:
            needed.append(f"{_split(chosen)}: {peak / 2 ** 30:.2f} GiB (the table said {chosen.memory_gib_per_gpu:.2f})")
            continue
        seconds = step_time(prog, hw, distributed_optimizer=chosen.distributed_optimizer, walks=walks).seconds
        if best is None or seconds < best[0]:
            prog.planned, prog.planned_memory, prog.planned_seconds = chosen, memory, seconds
            best = (seconds, prog)
    if best is None:
        raise ShardingError(f"world_size={world_size}: none of the planner's {len(needed)} fastest splits fits "
                            f"{(1 - RESERVED) * hw.memory_gib:.1f} usable GiB of {hw.name} when read off its compiled "
                            f"graphs: " + "; ".join(needed))
    return best[1]
