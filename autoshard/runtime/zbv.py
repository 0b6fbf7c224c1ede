"""ZBV: the V-shaped zero-bubble schedule (Qi et al. 2024), two half-size chunks per rank.

Rank r holds stage r (chunk 0, going down the V) and stage 2p - 1 - r (chunk 1, coming back up).
With at least 2p - 1 microbatches the schedule is written out in the paper's phases; each rank's
list, in order:

1. 2(p - r) - 1 chunk-0 forwards: the ranks lower in the V start first and run ahead;
2. r pairs (chunk-1 forward, chunk-0 forward): the up leg's first microbatches arrive;
3. p - r triples (chunk-1 F, B, W): the turn of the V, backwards begin;
4. the steady state, per microbatch: chunk-0 F (while any is left), B, W, then chunk-1 F, B, W;
5. r pairs (chunk-0 B, chunk-1 B), their W held back;
6. p - r pairs (chunk-0 B, the oldest held chunk-0 W);
7. the held W: chunk 1's, then chunk 0's, filling the cool-down's wait.

At F = B = W every rank is busy from its first action to its last: with consecutive steps
overlapped (each rank starting its next step when its own last action is done, as Qi et al.'s
optimizer post-validation allows) the bubble is 0, and a step that ends on every rank together
(this runtime's: the loss is all-reduced and the optimizer steps after it) idles only the last
rank's wait for the first half-size forwards, (p - 1) / 6m. Each rank holds at most 2p chunk
activations, 1F1B's memory.

With fewer microbatches the phases need microbatches that do not exist, and the schedule comes
from list scheduling under the same cap of 2p (runtime/list_schedule.py), which leaves less idle
there than the phases cut short would.
"""
from __future__ import annotations

from autoshard.runtime.list_schedule import list_schedule
from autoshard.runtime.pipeline_actions import Action

__all__ = ["zbv"]


class _Counts:
    """One rank's actions as they are written, with the next microbatch of each kind and chunk."""

    def __init__(self):
        self.actions: list[Action] = []
        self.next = {(kind, c): 0 for kind in "FBW" for c in (0, 1)}

    def add(self, kind: str, chunk: int) -> None:
        self.actions.append(Action(kind, chunk, self.next[(kind, chunk)]))
        self.next[(kind, chunk)] += 1


def _phased(pp: int, r: int, m: int) -> list[Action]:
    """Rank r's actions in the seven phases of the module doc."""
    me = _Counts()
    for _ in range(2 * (pp - r) - 1):
        me.add("F", 0)
    for _ in range(r):
        me.add("F", 1)
        me.add("F", 0)
    for _ in range(pp - r):
        for kind in "FBW":
            me.add(kind, 1)
    while me.next[("F", 0)] < m or me.next[("F", 1)] < m:
        if me.next[("F", 0)] < m:
            me.add("F", 0)
        for c in (0, 1):
            for kind in "FBW" if c else "BW":
                me.add(kind, c)
    for _ in range(r):
        me.add("B", 0)
        me.add("B", 1)
    for _ in range(pp - r):
        me.add("B", 0)
        me.add("W", 0)
    for c in (1, 0):
        while me.next[("W", c)] < m:
            me.add("W", c)
    return me.actions


def zbv(pp: int, m: int) -> list[list[Action]]:
    """Each rank's actions of ZBV for `pp` ranks (two chunks each, placed in a V) and `m` microbatches."""
    if m < 2 * pp - 1:
        return list_schedule(pp, 2, m, "v", cap=2 * pp)
    return [_phased(pp, r, m) for r in range(pp)]
