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
`choose_from_graph` (autoshard's schedule="auto") prices them on the captured graph, each stage
its own (the one with the embedding or the head waits in the simulator as it will in the run), and
charges the schedules that split the backward what the split costs (`split_backward`).
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Callable

import torch.fx as fx

from autoshard.errors import ShardingError
from autoshard.passes.stage_balance import Rates, balanced_counts, boundary_bytes, phase_costs
from autoshard.passes.stages import counts_from_cuts
from autoshard.runtime.schedules import check, frozen_schedule, peak_in_flight, schedule_spec

__all__ = ["StageTimes", "Candidate", "ScheduleChoice", "choose_schedule", "choose_from_graph", "bubble_of", "stage_times", "CANDIDATES"]

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
        weighed = any(c.activation_bytes for c in self.considered)
        rows = [f"{c.name} (v={c.virtual}): {c.seconds * 1e3:.3g} ms, bubble {100 * c.bubble:.1f}%"
                + (f", {c.peak_chunks} chunk(s) held = {c.activation_bytes / 2**30:.2f} GiB" if weighed else "")
                + ("" if c.fits else " (over the limit)") for c in self.considered]
        rows += [f"{name}: {why}" for name, why in self.refused.items()]
        why = ("the fastest within the memory limit" if weighed else "the fastest (memory not weighed)") \
            if self.chosen.fits else "none fits: the one holding the least"
        return f"schedule {self.chosen.name}, {why}; " + "; ".join(rows)

    def order(self) -> list[str]:
        """The candidates considered, fastest first."""
        return [c.name for c in sorted(self.considered, key=lambda c: c.seconds)]


@lru_cache(maxsize=4096)
def _run(name: str, pp: int, v: int, m: int, f: float, b: float, w: float) -> tuple[float, float, int]:
    spec = schedule_spec(name)
    steps = frozen_schedule(name, pp, v, m)
    t = check(steps, v, m, forward_cost=f / v, backward_cost=b / v, weight_cost=w / v, placement=spec.placement)
    return _summary(t, steps)


def _summary(t, steps) -> tuple[float, float, int]:
    """A run's makespan, its bubble (idle over busy time of the busiest rank) and its peak of chunks held."""
    busy = max(sum(e - s for _, s, e in row) for row in t.spans)
    return t.makespan, (t.makespan - busy) / busy, max(peak_in_flight(steps))


def choose_schedule(*, pp: int, microbatches: int, times: StageTimes | None = None, activation_bytes: float | None,
                    limit_bytes: float | None = None, names: tuple[str, ...] = CANDIDATES,
                    interleaved_chunks: int = 2, split_backward: float = 1.0,
                    per_stage: Callable[[int], list[StageTimes]] | None = None, hop_seconds: float = 0.0
                    ) -> ScheduleChoice:
    """The fastest of `names` within `limit_bytes` of activations (None: no limit); see the module doc.
    `split_backward`: what a schedule that splits the backward pays for it, B + W over one whole
    backward (a Hardware's `split_backward`); times are unsplit, B + W = one backward.
    `activation_bytes` None: memory is not weighed (every candidate fits). Times are one rank's
    (`times`, every rank alike) or each stage's (`per_stage(n_stages)`: a candidate's own cut into
    pp * v stages, so that a rank holding the embedding or the head waits as it will); with
    per-stage times the first stage's backward is whole in a split schedule, as the runtime runs it
    where its W follows its B (runtime/stage_actions.whole_backwards), and each message between
    ranks arrives `hop_seconds` after it was sent (interleaving sends twice as many)."""
    if (times is None) == (per_stage is None):
        raise ValueError("choose_schedule takes one of times= (a rank's) and per_stage= (each stage's)")
    considered, refused = [], {}
    for name in names:
        spec = schedule_spec(name)
        v = spec.chunks or interleaved_chunks
        cost = split_backward if spec.split else 1.0
        try:
            if per_stage is None:
                seconds, bubble, peak = _run(name, pp, v, microbatches, times.forward, cost * times.backward_input,
                                             cost * times.backward_weight)
            else:
                seconds, bubble, peak = _run_stages(name, pp, v, microbatches, per_stage(pp * v), cost, hop_seconds)
        except ShardingError as e:
            refused[name] = str(e)
            continue
        held = 0.0 if activation_bytes is None else peak * activation_bytes / v
        considered.append(Candidate(name, v, seconds, bubble, peak, held, limit_bytes is None or held <= limit_bytes))
    if not considered:
        raise ShardingError(f"no pipeline schedule runs pp={pp} with {microbatches} microbatches: {refused}")
    fitting = [c for c in considered if c.fits]
    best = min(fitting, key=lambda c: c.seconds) if fitting else min(considered, key=lambda c: c.activation_bytes)
    return ScheduleChoice(best, considered, refused)


def _run_stages(name: str, pp: int, v: int, m: int, stages: list[StageTimes], split_cost: float,
                hop: float) -> tuple[float, float, int]:
    """`_run` with each stage's own times (see choose_schedule)."""
    spec = schedule_spec(name)
    steps = frozen_schedule(name, pp, v, m)

    def cost_of(kind: str, stage: int) -> float:
        t = stages[stage]
        if kind == "F":
            return t.forward
        if not spec.split:
            return t.backward_input + t.backward_weight
        if stage == 0:                                   # whole in B, W empty
            return t.backward_input + t.backward_weight if kind == "B" else 0.0
        return split_cost * (t.backward_input if kind == "B" else t.backward_weight)
    return _summary(check(steps, v, m, placement=spec.placement, cost_of=cost_of, transfer=hop), steps)


def choose_from_graph(graph: fx.Graph, *, pp: int, virtual: int | None, microbatches: int, rates: Rates,
                      split_backward: float, link_bytes_s: float = float("inf"), latency_s: float = 0.0,
                      stage_cuts: list[int] | None = None) -> ScheduleChoice | None:
    """autoshard(schedule="auto"): the candidate the event simulator finds fastest at each stage's
    F, B and W, priced on the captured `graph` by passes/stage_balance.phase_costs on the cut the
    candidate would get (balanced by cost into its pp * v stages, or `stage_cuts`), zero-bubble
    candidates paying `split_backward`, each message between stages `latency_s` plus its bytes at
    `link_bytes_s`; None without a pipeline. A `virtual` given (None: free) or cuts given by hand
    allow only the candidates with that many chunks a rank or stages."""
    if pp == 1:
        if stage_cuts:
            raise ShardingError(f"stage_cuts={stage_cuts} need a pipeline (pp > 1)")
        return None
    interleaved = virtual if virtual is not None and virtual > 1 else 2
    names = CANDIDATES
    if virtual is not None:
        names = tuple(n for n in CANDIDATES if (schedule_spec(n).chunks or virtual) == virtual)
        if not names:
            raise ShardingError(f"schedule=\"auto\" with virtual={virtual}: no candidate runs {virtual} chunks a "
                                f"rank ({', '.join(CANDIDATES)})")
    if stage_cuts is not None:
        n_stages = len(stage_cuts) + 1
        names = tuple(n for n in names if pp * (schedule_spec(n).chunks or interleaved) == n_stages)
        if not names:
            raise ShardingError(f"schedule=\"auto\" with stage_cuts={stage_cuts}: {n_stages} stages are not 1 or "
                                f"{interleaved} per rank of pp={pp}")
    phases = phase_costs(graph, rates)

    def per_stage(n_stages: int) -> list[StageTimes]:
        counts = counts_from_cuts(list(stage_cuts), len(phases[0].layers), n_stages) if stage_cuts is not None \
            else balanced_counts(phases[0], n_stages)
        return [StageTimes(*t) for t in zip(*(c.stage_seconds(counts) for c in phases))]
    return choose_schedule(pp=pp, microbatches=microbatches, per_stage=per_stage, activation_bytes=None, names=names,
                           interleaved_chunks=interleaved, split_backward=split_backward,
                           hop_seconds=latency_s + boundary_bytes(graph) / link_bytes_s)


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
