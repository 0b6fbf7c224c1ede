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

Running a schedule (the second half of this file): `check` proves a schedule complete and free of
deadlock by running it as events: every rank executes its actions in order, an action starts once
its inputs exist (sends never block), and the run must finish. With given F, B and W costs the
resulting timeline gives the pipeline bubble: `bubble_fraction` for a step that ends on every rank
together (this runtime's), `overlapped_bubble` for consecutive steps run back to back with no step
boundary between the ranks (what Qi et al.'s optimizer post-validation buys; not run here).
`peak_in_flight` and `held_at_peak` count the chunk activations a rank holds at its peak.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, Sequence

from autoshard.errors import ShardingError, require_positive_int
from autoshard.runtime.list_schedule import list_schedule
from autoshard.runtime.pipeline_actions import Action, stage_index, stage_owner
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


# ---- running a schedule as events ----------------------------------------------------------

def splits_backward(schedule: Sequence[Sequence[Action]]) -> bool:
    """Whether the schedule has W actions (then each B computes the input gradients only)."""
    return any(a.kind == "W" for acts in schedule for a in acts)


@dataclass
class Timeline:
    """When each action ran: `spans[r]` is rank r's list of (action, start, end)."""
    spans: list[list[tuple[Action, float, float]]]
    placement: str = "loop"

    @property
    def makespan(self) -> float:
        return max(end for row in self.spans for _, _, end in row)


def _dependencies(kind: str, s: int, i: int, n_stages: int) -> list[tuple[str, int, int]]:
    if kind == "W":
        return [("B", s, i)]
    if kind == "F":
        return [("F", s - 1, i)] if s > 0 else []
    return [("F", s, i)] + ([("B", s + 1, i)] if s < n_stages - 1 else [])


def check(schedule: Sequence[Sequence[Action]], v: int, m: int, *, forward_cost: float = 1.0,
          backward_cost: float = 1.0, weight_cost: float = 0.0, placement: str = "loop",
          cost_of: Callable[[str, int], float] | None = None, transfer: float = 0.0) -> Timeline:
    """Run `schedule` with the given action costs (per chunk); raise ShardingError if it is
    incomplete or deadlocks. Returns the timeline. `backward_cost` is the input-gradient part of a
    backward and `weight_cost` the weight-gradient part: a whole B (no W actions) costs their sum,
    a split one `backward_cost` and each W `weight_cost`. `cost_of(kind, stage)`, when given, is
    each action's cost instead (stages differ: the first embeds, the last takes the loss).
    `transfer`: seconds a stage's output or input gradient takes to reach another rank (an action
    waiting on one starts that much after it ended)."""
    pp = len(schedule)
    n_stages = pp * v
    split = splits_backward(schedule)
    kinds = "FBW" if split else "FB"
    cost = {"F": forward_cost, "B": backward_cost + (0.0 if split else weight_cost), "W": weight_cost}
    want = {(k, s, i) for k in kinds for s in range(n_stages) for i in range(m)}
    seen: set[tuple[str, int, int]] = set()
    # per rank, each action with its (kind, stage, microbatch), what it waits for and its cost, worked
    # out once (the planner simulates schedules of 10^4 actions thousands of times a search)
    prepared: list[list[tuple[Action, tuple[str, int, int], list[tuple[tuple[str, int, int], float]], float]]] = []
    for r, acts in enumerate(schedule):
        row = []
        for a in acts:
            s = a.stage(r, pp, placement)
            key = (a.kind, s, a.microbatch)
            if key in seen or key not in want:
                raise ShardingError(f"rank {r}: action {a} is {'repeated' if key in seen else 'out of range'}")
            seen.add(key)
            deps = [(d, transfer if transfer and d[1] != s and stage_owner(d[1], pp, placement)[0] != r else 0.0)
                    for d in _dependencies(a.kind, s, a.microbatch, n_stages)]
            row.append((a, key, deps, cost_of(a.kind, s) if cost_of is not None else cost[a.kind]))
        prepared.append(row)
    if seen != want:
        missing = sorted(want - seen)[:4]
        raise ShardingError(f"schedule is incomplete: {len(want - seen)} actions missing, e.g. "
                            + ", ".join(f"{k}(stage {s}, microbatch {i})" for k, s, i in missing))
    # Each rank runs its actions in order until one needs an action not yet run, and is woken when
    # that one is done. An action starts at the later of its rank's clock and its inputs' ends, so
    # the timeline does not depend on the order in which the ranks are visited.
    done: dict[tuple[str, int, int], float] = {}
    pos, clock = [0] * pp, [0.0] * pp
    spans: list[list[tuple[Action, float, float]]] = [[] for _ in range(pp)]
    waiting: dict[tuple[str, int, int], list[int]] = {}       # an action not yet run -> the ranks stopped at it
    ready = deque(range(pp))
    while ready:
        r = ready.popleft()
        row, p, t = prepared[r], pos[r], clock[r]
        while p < len(row):
            a, key, deps, seconds = row[p]
            start, blocker = t, None
            for d, delay in deps:
                end = done.get(d)
                if end is None:
                    blocker = d
                    break
                start = max(start, end + delay)
            if blocker is not None:
                waiting.setdefault(blocker, []).append(r)
                break
            t = done[key] = start + seconds
            spans[r].append((a, start, t))
            p += 1
            ready.extend(waiting.pop(key, ()))
        pos[r], clock[r] = p, t
    if any(pos[r] < len(schedule[r]) for r in range(pp)):
        stuck = ", ".join(f"rank {r} waits at {schedule[r][pos[r]]}" for r in range(pp) if pos[r] < len(schedule[r]))
        raise ShardingError(f"schedule deadlocks: {stuck}")
    return Timeline(spans, placement)


def bubble_fraction(timeline: Timeline) -> float:
    """Pipeline bubble over ideal time (the paper's t_pb / t_id): idle time of the busiest rank
    divided by its busy time, from the first action anywhere to the last (a step ends on every rank
    together: the optimizer needs every gradient)."""
    busy = max(sum(e - s for _, s, e in row) for row in timeline.spans)
    return (timeline.makespan - busy) / busy


def overlapped_bubble(schedule: Sequence[Sequence[Action]], v: int, m: int, *, forward_cost: float = 1.0,
                      backward_cost: float = 1.0, weight_cost: float = 0.0, placement: str = "loop") -> float:
    """The bubble per step when steps run back to back with no boundary between the ranks: each
    rank starts step k + 1 once its own step-k actions are done (its optimizer needs only its own
    gradients, as with Qi et al.'s optimizer post-validation), so a rank that starts late may end
    late. Two and three steps are simulated; the third's added time over one step's work (the
    busiest rank's, half of its two steps') is the bubble. Not what this runtime does: its steps end
    together (`bubble_fraction`)."""
    def repeated(k: int) -> list[list[Action]]:
        return [[Action(a.kind, a.chunk, a.microbatch + j * m) for j in range(k) for a in acts] for acts in schedule]
    costs = dict(forward_cost=forward_cost, backward_cost=backward_cost, weight_cost=weight_cost, placement=placement)
    two, three = (check(repeated(k), v, k * m, **costs) for k in (2, 3))
    busy = max(sum(e - s for _, s, e in row) for row in two.spans) / 2
    return (three.makespan - two.makespan - busy) / busy


def held_at_peak(schedule: Sequence[Sequence[Action]], pending_weight: float) -> list[tuple[int, int]]:
    """Per rank, (chunk activations held, chunks waiting for their W) when `activations + pending_weight
    x waiting` peaks: between its B and its W a chunk also keeps the gradients B captured for W
    (runtime/backward_split.py), `pending_weight` of an activation's bytes."""
    out = []
    for acts in schedule:
        live = waiting = 0
        best, at = -1.0, (0, 0)
        for a in acts:
            live += 1 if a.kind == "F" else -1 if a.kind == "W" else 0
            waiting += 1 if a.kind == "B" else -1 if a.kind == "W" else 0
            if live + pending_weight * waiting > best:
                best, at = live + pending_weight * waiting, (live, waiting)
        out.append(at)
    return out


def peak_in_flight(schedule: Sequence[Sequence[Action]]) -> list[int]:
    """Per rank, the most chunk activations held at once: from a chunk's F to its W (or its B
    when the schedule has no W)."""
    release = "W" if splits_backward(schedule) else "B"
    out = []
    for acts in schedule:
        live = peak = 0
        for a in acts:
            live += 1 if a.kind == "F" else -1 if a.kind == release else 0
            peak = max(peak, live)
        out.append(peak)
    return out
