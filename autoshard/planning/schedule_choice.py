"""Which pipeline schedule to run: the event simulator (runtime/schedules.py's `check`) fed with a
stage's forward, input-gradient and weight-gradient times, under a memory limit.

    times = StageTimes(forward=0.010, backward_input=0.010, backward_weight=0.008)   # one rank, one microbatch
    choice = choose_schedule(pp=4, microbatches=8, times=times, activation_bytes=2e9, limit_bytes=12e9)
    choice.name, choice.explain()

Each candidate (1f1b, interleaved, zb-h1, zbv, v-half) is built for pp ranks and m microbatches and
run with its chunks' costs (a rank's times divided by its chunks per rank): its step time is the
run's makespan, its activation memory the schedule's own peak of chunks held (from F to W, or to B
without W: `peak_in_flight`) times a chunk's share of `activation_bytes` (what one microbatch leaves
on one rank's layers). The fastest schedule within `limit_bytes` wins; if none fits, the one holding
the least. Times can be the cost model's (planning/costmodel.py) or measured: `stage_times` reads
them from a step's trace (`MeshRuntime.records` of a zero-bubble schedule, which times B and W apart).
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from functools import lru_cache

from autoshard.errors import ShardingError
from autoshard.runtime.schedules import check, frozen_schedule, peak_in_flight, schedule_spec

__all__ = ["StageTimes", "Candidate", "ScheduleChoice", "choose_schedule", "bubble_of", "stage_times", "CANDIDATES"]

CANDIDATES = ("1f1b", "interleaved", "zb-h1", "zbv", "v-half")


@dataclass(frozen=True)
class StageTimes:
    """Seconds one pipeline rank spends on one microbatch (all its layers): forward, the backward's
    input-gradient part (B) and its weight-gradient part (W)."""
    forward: float
    backward_input: float
    backward_weight: float


@dataclass(frozen=True)
class Candidate:
    name: str
    virtual: int
    seconds: float            # the step's pipeline time (makespan)
    bubble: float             # idle over busy time of the busiest rank
    peak_chunks: int          # chunks of activations held at once, on the busiest rank
    activation_bytes: float   # what that peak holds
    fits: bool


@dataclass
class ScheduleChoice:
    chosen: Candidate
    considered: list[Candidate] = field(default_factory=list)
    refused: dict[str, str] = field(default_factory=dict)     # name -> why it could not run here

    @property
    def name(self) -> str:
        return self.chosen.name

    def explain(self) -> str:
        rows = [f"{c.name} (v={c.virtual}): {c.seconds * 1e3:.1f} ms, bubble {100 * c.bubble:.1f}%, "
                f"{c.peak_chunks} chunk(s) held = {c.activation_bytes / 2**30:.2f} GiB"
                + ("" if c.fits else " (over the limit)") for c in self.considered]
        rows += [f"{name}: {why}" for name, why in self.refused.items()]
        why = "the fastest within the memory limit" if self.chosen.fits else "none fits: the one holding the least"
        return f"schedule {self.chosen.name}, {why}; " + "; ".join(rows)


@lru_cache(maxsize=4096)
def _run(name: str, pp: int, v: int, m: int, f: float, b: float, w: float) -> tuple[float, float, int]:
    spec = schedule_spec(name)
    steps = frozen_schedule(name, pp, v, m)
    t = check(steps, v, m, forward_cost=f / v, backward_cost=b / v, weight_cost=w / v, placement=spec.placement)
    busy = max(sum(e - s for _, s, e in row) for row in t.spans)
    return t.makespan, (t.makespan - busy) / busy, max(peak_in_flight(steps))


def choose_schedule(*, pp: int, microbatches: int, times: StageTimes, activation_bytes: float,
                    limit_bytes: float | None = None, names: tuple[str, ...] = CANDIDATES,
                    interleaved_chunks: int = 2) -> ScheduleChoice:
    """The fastest of `names` within `limit_bytes` of activations (None: no limit); see the module doc."""
    considered, refused = [], {}
    for name in names:
        spec = schedule_spec(name)
        v = spec.chunks or interleaved_chunks
        try:
            seconds, bubble, peak = _run(name, pp, v, microbatches, times.forward, times.backward_input,
                                         times.backward_weight)
        except ShardingError as e:
            refused[name] = str(e)
            continue
        held = peak * activation_bytes / v
        considered.append(Candidate(name, v, seconds, bubble, peak, held, limit_bytes is None or held <= limit_bytes))
    if not considered:
        raise ShardingError(f"no pipeline schedule runs pp={pp} with {microbatches} microbatches: {refused}")
    fitting = [c for c in considered if c.fits]
    best = min(fitting, key=lambda c: c.seconds) if fitting else min(considered, key=lambda c: c.activation_bytes)
    return ScheduleChoice(best, considered, refused)


def bubble_of(name: str, pp: int, v: int, m: int, times: StageTimes) -> float:
    """The bubble of `name` (idle over busy time of the busiest rank) at these times. Beyond 4 pp
    microbatches the idle *time* of a schedule stops growing (warm-up and cool-down are fixed; the
    steady state is dense), so it is simulated at 4 pp and spread over m: the planner calls this for
    every configuration it weighs. B and W are rounded to tenths of the forward (the simulator's cache
    key: the planner's configurations share a few ratios)."""
    f = max(times.forward, 1e-30)
    b, w = (round(x / f, 1) for x in (times.backward_input, times.backward_weight))
    shown = min(m, 4 * pp)
    seconds, bubble, _ = _run(name, pp, v, shown, 1.0, b, w)
    idle = seconds - shown * (1.0 + b + w)
    return idle / (m * (1.0 + b + w))


def stage_times(records: list, rank: int | None = None) -> StageTimes:
    """Median F, B and W seconds per microbatch of one rank's recorded actions (ActionRecords of a
    zero-bubble schedule; summed over the rank's chunks). `rank`: a global rank (default: the one
    with the most W time; the first stage has none, its B being its whole backward)."""
    if rank is None:
        ranks = sorted({r.rank for r in records})
        rank = max(ranks, key=lambda k: sum(r.end - r.start for r in records if r.rank == k and r.action.kind == "W"))
    mine = [r for r in records if r.rank == rank]
    chunks = 1 + max((r.action.chunk for r in mine if r.action.kind in "FBW"), default=0)
    out = []
    for kind in "FBW":
        spans = [r.end - r.start for r in mine if r.action.kind == kind]
        if not spans:
            raise ShardingError(f"stage_times: rank {rank} recorded no {kind} action; time a zero-bubble schedule "
                                "(zb-h1, zbv, v-half), whose B and W run apart")
        out.append(statistics.median(spans) * chunks)
    return StageTimes(*out)
