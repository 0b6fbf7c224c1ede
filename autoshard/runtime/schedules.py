"""Pipeline schedules as data: each rank's ordered list of forward and backward actions.

A schedule is `list[list[Action]]`, one list per pipeline rank. Stage s of `pp * v` lives on rank
s % pp as its chunk s // pp (Megatron's interleaved assignment: chunk c of rank r is stage
c * pp + r). Communication is implied: F(stage s, m) receives from stage s - 1 and sends to s + 1,
B(stage s, m) receives from s + 1 and sends to s - 1.

- `gpipe`: all forwards, then all backwards (Huang et al. 2019).
- `one_f_one_b`: PipeDream-Flush; rank r warms up with pp - r - 1 forwards, then alternates.
- `interleaved_1f1b`: Megatron's interleaved schedule (Narayanan et al. 2021, section 2.2.1), with
  Megatron's warm-up count (pp - r - 1) * 2 + (v - 1) * pp; needs microbatches % pp == 0.

`check` proves a schedule complete and free of deadlock by running it: every rank executes its
actions in order, an action starts once its inputs exist (sends never block), and the run must
finish. With unit costs the resulting timeline gives the pipeline bubble.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from autoshard.errors import ShardingError, require_positive_int

__all__ = ["Action", "Timeline", "stage_index", "stage_owner", "gpipe", "one_f_one_b", "interleaved_1f1b", "make_schedule", "check",
           "bubble_fraction", "SCHEDULES"]


def stage_index(pp_rank: int, chunk: int, pp: int) -> int:
    """The stage that pipeline rank `pp_rank` runs as its chunk `chunk` (the one stage-to-rank rule)."""
    return chunk * pp + pp_rank


def stage_owner(stage: int, pp: int) -> tuple[int, int]:
    """(pipeline rank, chunk) of `stage`: the inverse of `stage_index`."""
    return stage % pp, stage // pp


@dataclass(frozen=True)
class Action:
    """Forward ("F") or backward ("B") of `microbatch` on this rank's `chunk`."""
    kind: str
    chunk: int
    microbatch: int

    def stage(self, rank: int, pp: int) -> int:
        return stage_index(rank, self.chunk, pp)

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}" + (f".{self.chunk}" if self.chunk else "")


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


# name -> (builder(pp, v, m), whether it runs more than one chunk per rank). A new schedule is a
# function returning each rank's actions and one row here; `check` proves it before it runs.
SCHEDULES: dict[str, tuple[Callable[[int, int, int], list[list[Action]]], bool]] = {
    "gpipe": (lambda pp, v, m: gpipe(pp, m), False),
    "1f1b": (lambda pp, v, m: one_f_one_b(pp, m), False),
    "interleaved": (_interleaved, True),
}


def make_schedule(name: str, pp: int, v: int, m: int) -> list[list[Action]]:
    """The named schedule; `interleaved` with v = 1 is 1F1B."""
    if name not in SCHEDULES:
        raise ShardingError(f"unknown schedule {name!r}; choose from {tuple(SCHEDULES)}")
    build, chunks = SCHEDULES[name]
    if v > 1 and not chunks:
        raise ShardingError(f"schedule {name!r} runs one chunk per rank; virtual={v} needs 'interleaved'")
    return build(pp, v, m)


@dataclass
class Timeline:
    """When each action ran: `spans[r]` is rank r's list of (action, start, end)."""
    spans: list[list[tuple[Action, float, float]]]

    @property
    def makespan(self) -> float:
        return max(end for row in self.spans for _, _, end in row)


def check(schedule: list[list[Action]], v: int, m: int, *, forward_cost: float = 1.0,
          backward_cost: float = 1.0) -> Timeline:
    """Run `schedule` with the given action costs; raise ShardingError if it is incomplete or
    deadlocks. Returns the timeline."""
    pp = len(schedule)
    n_stages = pp * v
    want = {(k, s, i) for k in "FB" for s in range(n_stages) for i in range(m)}
    seen: set[tuple[str, int, int]] = set()
    for r, acts in enumerate(schedule):
        for a in acts:
            key = (a.kind, a.stage(r, pp), a.microbatch)
            if key in seen or key not in want:
                raise ShardingError(f"rank {r}: action {a} is {'repeated' if key in seen else 'out of range'}")
            seen.add(key)
    if seen != want:
        missing = sorted(want - seen)[:4]
        raise ShardingError(f"schedule is incomplete: {len(want - seen)} actions missing, e.g. "
                            + ", ".join(f"{k}(stage {s}, microbatch {i})" for k, s, i in missing))
    done: dict[tuple[str, int, int], float] = {}
    pos, clock = [0] * pp, [0.0] * pp
    spans: list[list[tuple[Action, float, float]]] = [[] for _ in range(pp)]
    while any(pos[r] < len(schedule[r]) for r in range(pp)):
        progressed = False
        for r in range(pp):
            while pos[r] < len(schedule[r]):
                a = schedule[r][pos[r]]
                s = a.stage(r, pp)
                deps = [("F", s, a.microbatch)] if a.kind == "B" else []
                if a.kind == "F" and s > 0:
                    deps.append(("F", s - 1, a.microbatch))
                if a.kind == "B" and s < n_stages - 1:
                    deps.append(("B", s + 1, a.microbatch))
                if any(d not in done for d in deps):
                    break
                start = max([clock[r]] + [done[d] for d in deps])
                end = start + (forward_cost if a.kind == "F" else backward_cost)
                done[(a.kind, s, a.microbatch)] = clock[r] = end
                spans[r].append((a, start, end))
                pos[r] += 1
                progressed = True
        if not progressed:
            stuck = ", ".join(f"rank {r} waits at {schedule[r][pos[r]]}" for r in range(pp)
                              if pos[r] < len(schedule[r]))
            raise ShardingError(f"schedule deadlocks: {stuck}")
    return Timeline(spans)


def bubble_fraction(timeline: Timeline) -> float:
    """Pipeline bubble over ideal time (the paper's t_pb / t_id): idle time of the busiest rank
    divided by its busy time."""
    busy = max(sum(e - s for _, s, e in row) for row in timeline.spans)
    return (timeline.makespan - busy) / busy
