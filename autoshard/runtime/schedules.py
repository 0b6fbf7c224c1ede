"""Pipeline schedules as data: each rank's ordered list of forward, backward and weight actions.

A schedule is `list[list[Action]]` (runtime/pipeline_actions.py), one list per pipeline rank.
Stage s of `pp * v` lives where the schedule's placement puts it: "loop" (Megatron's interleaved
assignment, chunk c of rank r is stage c * pp + r) or "v" (two chunks, down the ranks and back up).
Communication is implied: F(stage s, m) receives from stage s - 1 and sends to s + 1, B(stage s, m)
receives from s + 1 and sends to s - 1; W(stage s, m) runs on its rank alone after B(stage s, m).

- `gpipe`: all forwards, then all backwards (Huang et al. 2019).
- `1f1b`: PipeDream-Flush; rank r warms up with pp - r - 1 forwards, then alternates.
- `interleaved`: Megatron's interleaved schedule (Narayanan et al. 2021, section 2.2.1), with
  Megatron's warm-up count (pp - r - 1) * 2 + (v - 1) * pp; needs microbatches % pp == 0.
- `zb-h1` (Qi et al. 2023): 1F1B's order with each backward split into B and W, rank r running the
  W of microbatch i after the B of microbatch i + r. The cool-down's idle time is filled with the
  deferred W, so the bubble is (p - 1)(F + B - W): a third of 1F1B's at F = B = W, with 1F1B's peak
  of p microbatches in flight.
- `zbv` (Qi et al. 2024): two chunks per rank in a V, written out in the paper's phases for m >= 2p - 1
  (runtime/zbv.py; list-scheduled below that), holding 2p chunk activations (1F1B's memory).
- `v-half` (Qi et al. 2024): two chunks per rank in a V, built by list scheduling
  (runtime/list_schedule.py) under a cap of p + 1 chunk activations (about half of 1F1B's).

Running a schedule (runtime/schedule_run.py, its names also importable from here): `check` proves
a schedule complete and free of deadlock by running it as events and returns its timeline (the
bubble: `bubble_fraction`, `overlapped_bubble`); `peak_in_flight` and `held_at_peak` count the
activations a rank holds.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Callable

from autoshard.errors import ShardingError, require_positive_int
from autoshard.runtime.list_schedule import list_schedule
from autoshard.runtime.pipeline_actions import Action, stage_index, stage_owner
from autoshard.runtime.schedule_run import (Timeline, bubble_fraction, check, held_at_peak, overlapped_bubble,
                                           peak_in_flight, splits_backward)
from autoshard.runtime.zbv import zbv

__all__ = ["Action", "ScheduleSpec", "Timeline", "stage_index", "stage_owner", "gpipe", "one_f_one_b",
           "interleaved_1f1b", "zb_h1", "make_schedule", "frozen_schedule", "schedule_spec", "splits_backward", "check",
           "bubble_fraction", "overlapped_bubble", "peak_in_flight", "held_at_peak", "SCHEDULES"]


def _validate(pp: int, v: int, m: int) -> None:
    for name, x in (("pp", pp), ("virtual chunks", v), ("microbatches", m)):
        require_positive_int(name, x)


def gpipe(pp: int, m: int) -> list[list[Action]]:
    _validate(pp, 1, m)
    return [[Action("F", 0, i) for i in range(m)] + [Action("B", 0, i) for i in range(m)] for _ in range(pp)]


def one_f_one_b(pp: int, m: int) -> list[list[Action]]:
    _validate(pp, 1, m)
    out = []
    for r in range(pp):
        warmup = min(pp - r - 1, m)
        acts = [Action("F", 0, i) for i in range(warmup)]
        for i in range(m - warmup):        # steady state: one forward, one backward
            acts += [Action("F", 0, warmup + i), Action("B", 0, i)]
        acts += [Action("B", 0, i) for i in range(m - warmup, m)]
        out.append(acts)
    return out


def _virtual(k: int, pp: int, v: int, forward: bool) -> tuple[int, int]:
    """(chunk, microbatch) of a rank's k-th forward or backward: groups of pp microbatches
    go through chunk 0, 1, ..., v - 1 (backwards: v - 1, ..., 0) before the next group starts."""
    in_group = k % (pp * v)
    chunk = in_group // pp
    return (chunk if forward else v - 1 - chunk), (k // (pp * v)) * pp + in_group % pp


def interleaved_1f1b(pp: int, v: int, m: int) -> list[list[Action]]:
    _validate(pp, v, m)
    if m % pp:
        raise ShardingError(f"the interleaved schedule needs microbatches divisible by pp: "
                            f"{m} microbatches, pp={pp}")
    total = m * v
    out = []
    for r in range(pp):
        warmup = total if m == pp else min((pp - r - 1) * 2 + (v - 1) * pp, total)
        acts = [Action("F", *_virtual(k, pp, v, True)) for k in range(warmup)]
        for k in range(total - warmup):
            acts += [Action("F", *_virtual(warmup + k, pp, v, True)), Action("B", *_virtual(k, pp, v, False))]
        acts += [Action("B", *_virtual(k, pp, v, False)) for k in range(total - warmup, total)]
        out.append(acts)
    return out


def _interleaved(pp: int, v: int, m: int) -> list[list[Action]]:
    return interleaved_1f1b(pp, v, m) if v > 1 else one_f_one_b(pp, m)     # one chunk: plain 1F1B


def zb_h1(pp: int, m: int) -> list[list[Action]]:
    """ZB-H1: 1F1B's order, each backward split into B and W; rank r runs W(i) after B(i + r) and
    the last r W at the end, so it holds at most pp microbatches (rank 0's count in 1F1B)."""
    out = []
    for r, acts in enumerate(one_f_one_b(pp, m)):
        row = []
        for a in acts:
            row.append(a)
            if a.kind == "B" and a.microbatch >= r:
                row.append(Action("W", 0, a.microbatch - r))
        out.append(row + [Action("W", 0, i) for i in range(max(m - r, 0), m)])
    return out


@dataclass(frozen=True)
class ScheduleSpec:
    """One schedule: its builder(pp, v, m), the chunks per rank it runs (None: any), where its
    stages live, and whether it splits each backward into B and W."""
    build: Callable[[int, int, int], list[list[Action]]]
    chunks: int | None = 1
    placement: str = "loop"
    split: bool = False


# A new schedule is a function returning each rank's actions and one row here; `check` proves it
# before it runs.
SCHEDULES: dict[str, ScheduleSpec] = {
    "gpipe": ScheduleSpec(lambda pp, v, m: gpipe(pp, m)),
    "1f1b": ScheduleSpec(lambda pp, v, m: one_f_one_b(pp, m)),
    "interleaved": ScheduleSpec(_interleaved, chunks=None),
    "zb-h1": ScheduleSpec(lambda pp, v, m: zb_h1(pp, m), split=True),
    "zbv": ScheduleSpec(lambda pp, v, m: zbv(pp, m), chunks=2, placement="v", split=True),
    "v-half": ScheduleSpec(lambda pp, v, m: list_schedule(pp, 2, m, "v", cap=pp + 1), chunks=2, placement="v",
                           split=True),
}


def schedule_spec(name: str) -> ScheduleSpec:
    if name not in SCHEDULES:
        raise ShardingError(f"unknown schedule {name!r}; choose from {tuple(SCHEDULES)}")
    return SCHEDULES[name]


def make_schedule(name: str, pp: int, v: int, m: int) -> list[list[Action]]:
    """The named schedule; `interleaved` with v = 1 is 1F1B; `zbv` and `v-half` need v = 2."""
    spec = schedule_spec(name)
    _validate(pp, v, m)
    if spec.chunks == 1 and v > 1:
        raise ShardingError(f"schedule {name!r} runs one chunk per rank; virtual={v} needs 'interleaved'")
    if spec.chunks is not None and spec.chunks != v:
        raise ShardingError(f"schedule {name!r} runs {spec.chunks} chunks per rank in a V; got virtual={v} "
                            f"(pass virtual={spec.chunks})")
    return spec.build(pp, v, m)


@lru_cache(maxsize=256)
def frozen_schedule(name: str, pp: int, v: int, m: int) -> tuple[tuple[Action, ...], ...]:
    """`make_schedule`'s actions as read-only tuples, built once per arguments: the planner simulates
    one schedule at many F, B and W times."""
    return tuple(tuple(acts) for acts in make_schedule(name, pp, v, m))
