"""Schedules found by list scheduling: a unit-cost run in which every rank, whenever it is free,
starts the most urgent action it can, under a cap on the activations it holds.

The V-shaped zero-bubble schedules (ZBV and V-Half, Qi et al. 2024) are built this way rather than
written out by hand: their shape follows from three rules and one number.
- A backward whose gradient has arrived goes first (it is on the critical path); the oldest
  microbatch first, then the later stage.
- Else a forward, if the rank holds fewer than `cap` chunk activations (a chunk 0 forward leaves
  room for the chunk 1 forward that would free it; later stages first, so microbatches finish).
- Else a weight-gradient pass, oldest first: W fills what would be idle time.
A chunk's activation is held from its F to its W. Each stage runs its forwards and its backwards in
microbatch order (runtime/p2p.py's headers and issue order rely on it). The run uses unit costs
(F = B = W); `schedules.check` proves the resulting order complete and deadlock-free.
"""
from __future__ import annotations

import bisect
from functools import lru_cache

from autoshard.errors import ShardingError
from autoshard.runtime.pipeline_actions import Action, stage_index

__all__ = ["list_schedule"]


class _Rank:
    """One rank's state in the run."""

    def __init__(self, v: int):
        self.clock = 0.0
        self.blocked_at = -1.0       # the time it last found nothing to start
        self.next_f = [0] * v        # per chunk: the next microbatch to forward
        self.next_b = [0] * v        # per chunk: the next microbatch to back-propagate
        self.pending_w: list[tuple[int, int]] = []     # (chunk, microbatch) with B done, W not
        self.live = 0                # chunk activations held (F done, W not)
        self.actions: list[Action] = []


def list_schedule(pp: int, v: int, m: int, placement: str, cap: int) -> list[list[Action]]:
    """Each rank's F, B and W actions for `pp` ranks of `v` chunks placed by `placement`, `m`
    microbatches, at most `cap` chunk activations held per rank."""
    return [list(row) for row in _built(pp, v, m, placement, cap)]


@lru_cache(maxsize=256)
def _built(pp: int, v: int, m: int, placement: str, cap: int) -> tuple[tuple[Action, ...], ...]:
    if cap < v:
        raise ShardingError(f"a cap of {cap} chunk activations cannot hold one microbatch's {v} chunks")
    n, total = pp * v, 3 * v * m
    ranks = [_Rank(v) for _ in range(pp)]
    done: dict[tuple[str, int, int], float] = {}

    def ready(key: tuple[str, int, int], now: float) -> bool:
        return key in done and done[key] <= now

    def pick(r: int, now: float) -> Action | None:
        me = ranks[r]
        backs = []
        for c in range(v):
            i, s = me.next_b[c], stage_index(r, c, pp, placement)
            if i < me.next_f[c] and ready(("F", s, i) if s == n - 1 else ("B", s + 1, i), now):
                backs.append((i, -s, c))
        if backs:
            i, _, c = min(backs)
            return Action("B", c, i)
        fronts = []
        for c in range(v):
            i, s = me.next_f[c], stage_index(r, c, pp, placement)
            if i < m and me.live < cap - (v - 1 - c) and (s == 0 or ready(("F", s - 1, i), now)):
                fronts.append((-s, c, i))
        if fronts:
            _, c, i = min(fronts)
            return Action("F", c, i)
        if me.pending_w:
            return Action("W", *me.pending_w[0])
        return None

    ends: list[float] = []
    while len(done) < n * m * 3:
        busy = [r for r in range(pp) if len(ranks[r].actions) < total]
        r = min(busy, key=lambda x: (ranks[x].clock, ranks[x].blocked_at == ranks[x].clock, x))
        me, now = ranks[r], ranks[r].clock
        a = pick(r, now)
        if a is None:          # wait for the next thing to finish, or let a rank free at this instant go first
            k = bisect.bisect_right(ends, now)
            later = ends[k:k + 1] + [ranks[x].clock for x in busy if ranks[x].clock > now]
            if later:
                me.clock = min(later)
            elif all(ranks[x].blocked_at == now for x in busy if x != r and ranks[x].clock == now):
                raise ShardingError(f"list scheduling stalls at pp={pp}, v={v}, m={m}, cap={cap}")
            else:
                me.blocked_at = now
            continue
        me.clock = now + 1.0
        done[(a.kind, a.stage(r, pp, placement), a.microbatch)] = me.clock
        bisect.insort(ends, me.clock)
        me.actions.append(a)
        if a.kind == "F":
            me.next_f[a.chunk] += 1
            me.live += 1
        elif a.kind == "B":
            me.next_b[a.chunk] += 1
            me.pending_w.append((a.chunk, a.microbatch))
        else:
            me.pending_w.pop(0)
            me.live -= 1
    return tuple(tuple(me.actions) for me in ranks)
