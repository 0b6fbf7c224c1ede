"""What a pipeline schedule is made of: actions, and where each stage lives.

An `Action` is one rank's forward ("F"), backward ("B") or weight-gradient ("W") pass of one
microbatch on one of its chunks. In a schedule without W actions a B is the whole backward; with
them (the zero-bubble schedules, Qi et al. 2023) B computes only the gradients of the stage's
inputs, what the previous stage waits for, and W the gradients of its parameters, free to move
(runtime/backward_split.py runs the two halves).

A placement maps (pipeline rank, chunk) to a stage of pp * v:
- "loop" (Megatron's interleaved assignment): chunk c of rank r is stage c * pp + r, so the
  stages go round the ranks v times;
- "v" (two chunks, Qi et al. 2024): chunk 0 of rank r is stage r and chunk 1 is stage 2 pp - 1 - r,
  so the stages go down the ranks and back up, and rank 0 holds the first and the last stage.
"""
from __future__ import annotations

from dataclasses import dataclass

from autoshard.errors import ShardingError

__all__ = ["Action", "PLACEMENTS", "stage_index", "stage_owner"]

PLACEMENTS = ("loop", "v")


def _check_placement(placement: str) -> None:
    if placement not in PLACEMENTS:
        raise ShardingError(f"unknown stage placement {placement!r}; choose from {PLACEMENTS}")


def stage_index(pp_rank: int, chunk: int, pp: int, placement: str = "loop") -> int:
    """The stage that pipeline rank `pp_rank` runs as its chunk `chunk` (the one stage-to-rank rule)."""
    _check_placement(placement)
    if placement == "v":
        return pp_rank if chunk == 0 else 2 * pp - 1 - pp_rank
    return chunk * pp + pp_rank


def stage_owner(stage: int, pp: int, placement: str = "loop") -> tuple[int, int]:
    """(pipeline rank, chunk) of `stage`: the inverse of `stage_index`."""
    _check_placement(placement)
    if placement == "v":
        return (stage, 0) if stage < pp else (2 * pp - 1 - stage, 1)
    return stage % pp, stage // pp


@dataclass(frozen=True)
class Action:
    """Forward ("F"), backward ("B") or weight gradient ("W") of `microbatch` on this rank's `chunk`."""
    kind: str
    chunk: int
    microbatch: int

    def stage(self, rank: int, pp: int, placement: str = "loop") -> int:
        return stage_index(rank, self.chunk, pp, placement)

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}" + (f".{self.chunk}" if self.chunk else "")
