"""Schedule timelines: a Chrome trace (open in Perfetto or chrome://tracing) and a PNG picture.

Both take `ActionRecord`s: the executor's measured ones (`MeshRuntime.records`, gathered from
every rank by `export_trace`) or a schedule's unit-cost run (`records_of(check(...))`). The PNG has
one row per pipeline rank, time to the right; forwards are blue, backwards green, weight-gradient
passes of the zero-bubble schedules (kind "W") red, a darker shade for each later chunk, and each
box is labelled with its microbatch number; a data-parallel gradient
reduction (one bucket of runtime/gradients.py, action kind "R") is a thin orange bar along the bottom of
its row, so its overlap with backward shows. At cp > 1 each ring attention step is two records
(parallel/ring_steps.py): its block's compute (kind "A") and its point-to-point exchange (kind "X"),
chunk 0 in forward and 1 in backward, the ring step in the microbatch field; the picture draws them
as thin bars along the top of the row (exchange purple above, compute teal below it), the Chrome
trace on two threads of their own, so the exchange's overlap with the compute shows. Times are the
host's (time.time()): on a GPU they are when work was issued. It is drawn with the standard library
alone (autoshard/png.py), so no plotting package is needed.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

from autoshard import png
from autoshard.parallel.ring_steps import RingStep
from autoshard.runtime.json_gather import all_gather_json
from autoshard.runtime.schedules import Action, Timeline
from autoshard.world import current

__all__ = ["REDUCE", "RING_BLOCK", "RING_EXCHANGE", "ActionRecord", "records_of", "ring_records", "chrome_trace",
           "write_png", "text_timeline", "export_trace"]

REDUCE = "R"          # an ActionRecord's kind for a gradient bucket's reduction (its microbatch: the bucket)
REDUCE_TID = 1000     # the Chrome-trace thread the reductions are drawn on
RING_BLOCK, RING_EXCHANGE = "A", "X"        # a ring step's compute and exchange (microbatch: the step)
RING_TIDS = {RING_BLOCK: 1001, RING_EXCHANGE: 1002}
_RING_COLOURS = {RING_BLOCK: (0, 150, 136), RING_EXCHANGE: (142, 68, 173)}
_RING_ROWS = {RING_EXCHANGE: (1, 3), RING_BLOCK: (3, 5)}     # pixel rows below the row's top
STAGE_KINDS = {"F": "forward", "B": "backward", "W": "weight"}      # a stage's actions, their trace category
_BOXES = {"F": (66, 133, 244), "B": (52, 168, 83), "W": (219, 68, 55)}


@dataclass(frozen=True)
class ActionRecord:
    """One action as it ran: global rank, pipeline rank (the picture's row), stage, start, end (s)."""
    rank: int
    row: int
    stage: int
    action: Action
    start: float
    end: float


def records_of(timeline: Timeline, seconds_per_unit: float = 1.0) -> list[ActionRecord]:
    pp = len(timeline.spans)
    return [ActionRecord(r, r, a.stage(r, pp, timeline.placement), a, s * seconds_per_unit, e * seconds_per_unit)
            for r, row in enumerate(timeline.spans) for a, s, e in row]


def ring_records(steps: list[RingStep], rank: int, row: int, origin: float) -> list[ActionRecord]:
    """A step's recorded ring steps as ActionRecords (times from `origin`, as the step's own)."""
    out = []
    for s in steps:
        spans = [(RING_BLOCK, s.compute)] + ([(RING_EXCHANGE, s.exchange)] if s.exchange is not None else [])
        out += [ActionRecord(rank, row, -1, Action(kind, int(s.backward), s.step), a - origin, b - origin)
                for kind, (a, b) in spans]
    return out


def chrome_trace(records: list[ActionRecord]) -> dict:
    """Chrome trace-event JSON: one process per global rank, one complete event per action."""
    t0 = min(r.start for r in records)
    events = [{"name": f"{r.action.kind} mb{r.action.microbatch}", "cat": STAGE_KINDS[r.action.kind],
               "ph": "X", "pid": r.rank, "tid": r.row, "ts": (r.start - t0) * 1e6, "dur": (r.end - r.start) * 1e6,
               "args": {"stage": r.stage, "chunk": r.action.chunk, "microbatch": r.action.microbatch}}
              for r in records if r.action.kind in STAGE_KINDS]
    # gradient buckets' data-parallel reductions, on a thread of their own under the rank
    events += [{"name": f"reduce bucket {r.action.microbatch}", "cat": "grad-reduce", "ph": "X", "pid": r.rank,
                "tid": REDUCE_TID, "ts": (r.start - t0) * 1e6, "dur": (r.end - r.start) * 1e6,
                "args": {"bucket": r.action.microbatch}} for r in records if r.action.kind == REDUCE]
    # ring attention steps (cp > 1): each step's block compute and its exchange, a thread each
    events += [{"name": f"ring {'backward' if r.action.chunk else 'forward'} "
                        f"{'block' if r.action.kind == RING_BLOCK else 'exchange'} {r.action.microbatch}",
                "cat": "ring", "ph": "X", "pid": r.rank, "tid": RING_TIDS[r.action.kind], "ts": (r.start - t0) * 1e6,
                "dur": (r.end - r.start) * 1e6, "args": {"step": r.action.microbatch}}
               for r in records if r.action.kind in RING_TIDS]
    events += [{"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}}
               for rank in sorted({r.rank for r in records})]
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def _shade(kind: str, chunk: int, chunks: int) -> tuple[int, int, int]:
    base = _BOXES[kind]
    k = 1.0 - 0.45 * chunk / max(chunks - 1, 1)
    return tuple(int(c * k) for c in base)


def write_png(records: list[ActionRecord], path: str, width: int = 1200, row_height: int = 28) -> None:
    """Draw one row per pipeline rank (`ActionRecord.row`); rows of equal `row` from several
    tensor- or data-parallel ranks are drawn from the first of them."""
    rows = sorted({r.row for r in records})
    first = {row: min(r.rank for r in records if r.row == row) for row in rows}
    shown = [r for r in records if r.rank == first[r.row]]
    t0, t1 = min(r.start for r in shown), max(r.end for r in shown)
    chunks = max((r.action.chunk for r in shown if r.action.kind in STAGE_KINDS), default=0) + 1
    height = row_height * len(rows) + 8
    img = png.blank(width, height)
    scale = (width - 8) / max(t1 - t0, 1e-12)
    for r in sorted(shown, key=lambda r: r.action.kind not in STAGE_KINDS):     # thin bars over the boxes
        y0 = 4 + rows.index(r.row) * row_height
        if r.action.kind == REDUCE or r.action.kind in _RING_ROWS:
            x0, x1 = 4 + int((r.start - t0) * scale), 4 + max(int((r.end - t0) * scale), int((r.start - t0) * scale) + 1)
            if r.action.kind == REDUCE:       # a thin orange bar along the bottom of the row
                ys, colour = range(y0 + row_height - 6, y0 + row_height - 2), (244, 160, 0)
            else:                             # a ring step's exchange or compute, along the top
                a, b = _RING_ROWS[r.action.kind]
                ys, colour = range(y0 + a, y0 + b), _RING_COLOURS[r.action.kind]
            for y in ys:
                img[y][x0:x1] = [colour] * (x1 - x0)
            continue
        x0, x1 = 4 + int((r.start - t0) * scale), 4 + max(int((r.end - t0) * scale) - 1, int((r.start - t0) * scale) + 1)
        for y in range(y0 + 2, y0 + row_height - 2):
            img[y][x0:x1] = [_shade(r.action.kind, r.action.chunk, chunks)] * (x1 - x0)
        _label(img, str(r.action.microbatch), x0, x1, y0 + row_height // 2)
    png.write(img, path)


def _label(img: png.Image, text: str, x0: int, x1: int, ymid: int, px: int = 2) -> None:
    """`text` in white, centred in the box from x0 to x1 when it fits."""
    w = png.text_width(text, px)
    if x1 - x0 < w + 4:
        return
    png.draw_text(img, text, x0 + (x1 - x0 - w) // 2, ymid - 5 * px // 2, px, (255, 255, 255))


def export_trace(records: list[ActionRecord], prefix: str) -> None:
    """Gather every rank's records (inside torchrun) and write `prefix`.json and `prefix`.png on rank 0."""
    everyone = [records]
    world = current()
    if world.size() > 1:
        rows = [[r.rank, r.row, r.stage, r.action.kind, r.action.chunk, r.action.microbatch, r.start, r.end]
                for r in records]
        everyone = [[ActionRecord(a, b, c, Action(k, ch, m), s, e) for a, b, c, k, ch, m, s, e in part]
                    for part in all_gather_json(rows)]
        if world.rank() != 0:
            return
    flat = [r for part in everyone for r in part]
    os.makedirs(os.path.dirname(prefix) or ".", exist_ok=True)
    with open(prefix + ".json", "w") as fh:
        json.dump(chrome_trace(flat), fh)
    write_png(flat, prefix + ".png")



def text_timeline(timeline: Timeline) -> str:
    """A unit-cost timeline as text: one row per rank, one column per step; F/B/W for chunk 0,
    f/b/w for chunk 1 (then G/C/X ...), the microbatch number after it, `..` when idle."""
    letters = ["FBW", "fbw", "GCX", "gcx"]
    lines = []
    for r, row in enumerate(timeline.spans):
        cells = [".  "] * int(timeline.makespan)
        for a, start, end in row:
            kind = letters[a.chunk % len(letters)]["FBW".index(a.kind)]
            cells[int(start)] = f"{kind}{a.microbatch:<2}"
            for k in range(int(start) + 1, int(end)):      # a longer action goes on
                cells[k] = "-  "
        lines.append(f"rank {r} | " + "".join(cells).rstrip())
    return "\n".join(lines)

