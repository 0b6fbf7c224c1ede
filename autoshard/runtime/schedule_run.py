"""What a pipeline schedule does when it runs: its timeline, found by running it as events, and the
activations each rank holds.

`check` proves a schedule (runtime/schedules.py) complete and free of deadlock by running it: every
rank executes its actions in order, an action starts once its inputs exist (sends never block), and
the run must finish. With given F, B and W costs the resulting timeline gives the pipeline bubble:
`bubble_fraction` for a step that ends on every rank together (this runtime's), `overlapped_bubble`
for consecutive steps run back to back with no step boundary between the ranks (what Qi et al.'s
optimizer post-validation buys; not run here). `peak_in_flight` and `held_at_peak` count the chunk
activations a rank holds at its peak.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable, Sequence

from autoshard.errors import ShardingError
from autoshard.runtime.pipeline_actions import Action

__all__ = ["Timeline", "splits_backward", "check", "bubble_fraction", "overlapped_bubble", "held_at_peak",
           "peak_in_flight"]


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
          cost_of: Callable[[str, int], float] | None = None) -> Timeline:
    """Run `schedule` with the given action costs (per chunk); raise ShardingError if it is
    incomplete or deadlocks. Returns the timeline. `backward_cost` is the input-gradient part of a
    backward and `weight_cost` the weight-gradient part: a whole B (no W actions) costs their sum,
    a split one `backward_cost` and each W `weight_cost`. `cost_of(kind, stage)`, when given, is
    each action's cost instead (stages differ: the first embeds, the last takes the loss)."""
    pp = len(schedule)
    n_stages = pp * v
    split = splits_backward(schedule)
    kinds = "FBW" if split else "FB"
    cost = {"F": forward_cost, "B": backward_cost + (0.0 if split else weight_cost), "W": weight_cost}
    want = {(k, s, i) for k in kinds for s in range(n_stages) for i in range(m)}
    seen: set[tuple[str, int, int]] = set()
    # per rank, each action with its (kind, stage, microbatch), what it waits for and its cost, worked
    # out once (the planner simulates schedules of 10^4 actions thousands of times a search)
    prepared: list[list[tuple[Action, tuple[str, int, int], list[tuple[str, int, int]], float]]] = []
    for r, acts in enumerate(schedule):
        row = []
        for a in acts:
            s = a.stage(r, pp, placement)
            key = (a.kind, s, a.microbatch)
            if key in seen or key not in want:
                raise ShardingError(f"rank {r}: action {a} is {'repeated' if key in seen else 'out of range'}")
            seen.add(key)
            row.append((a, key, _dependencies(a.kind, s, a.microbatch, n_stages),
                        cost_of(a.kind, s) if cost_of is not None else cost[a.kind]))
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
            for d in deps:
                end = done.get(d)
                if end is None:
                    blocker = d
                    break
                start = max(start, end)
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
