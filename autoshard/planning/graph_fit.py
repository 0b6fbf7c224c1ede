"""The planner's pick checked against the compiled program: the fastest of its candidate splits whose
every pipeline rank fits the device, each rank's peak read off its own graphs (graph_memory.py).

    prog = first_that_fits(plan(model, gpus=8, ...), hw, build=lambda chosen: compile(chosen), world_size=8)
    prog.planned, prog.planned_memory          # the chosen Estimate; each pipeline rank's RankMemory

The planner ranks splits with its closed-form memory (memory_model.py: Megatron's GPT table), which
is exact for that GPT and off for other layers (a written-out activation saves more, attention
without dropout less). Its candidates are compiled in order, at most `tries` of them, and the first
whose graphs fit is kept; when none does the error lists what each needs.
"""
from __future__ import annotations

from typing import Callable

import torch

from autoshard.errors import ShardingError
from autoshard.planning.estimate import RESERVED, Estimate
from autoshard.planning.graph_memory import program_memory
from autoshard.planning.hardware import Hardware

__all__ = ["first_that_fits"]


def _device_of(hw: Hardware) -> torch.device:
    """Where the planned ranks run: the CPU for a measured CPU profile, else a GPU."""
    return torch.device("cpu" if hw.name == "cpu" else "cuda")


def _split(e: Estimate) -> str:
    return (f"tp={e.tp} pp={e.pp} dp={e.dp} v={e.virtual} microbatch={e.microbatch} recompute={e.recompute}"
            + (" distributed-optimizer" if e.distributed_optimizer else ""))


def first_that_fits(candidates: list[Estimate], hw: Hardware, build: Callable[[Estimate], object], world_size: int,
                    tries: int = 4):
    """`build(chosen)` for the fastest candidate whose ranks fit `hw` (see the module doc)."""
    usable = (1 - RESERVED) * hw.memory_gib * 2 ** 30
    needed = []
    for chosen in candidates[:tries]:
        prog = build(chosen)
        memory = program_memory(prog, batch=chosen.microbatch, distributed_optimizer=chosen.distributed_optimizer,
                                device=_device_of(hw))
        peak = max(m.peak for m in memory)
        if peak <= usable:
            prog.planned, prog.planned_memory = chosen, memory
            return prog
        needed.append(f"{_split(chosen)}: {peak / 2 ** 30:.2f} GiB (the table said {chosen.memory_gib_per_gpu:.2f})")
    raise ShardingError(f"world_size={world_size}: none of the planner's {len(needed)} fastest splits fits "
                        f"{(1 - RESERVED) * hw.memory_gib:.1f} usable GiB of {hw.name} when read off its compiled "
                        f"graphs: " + "; ".join(needed))
