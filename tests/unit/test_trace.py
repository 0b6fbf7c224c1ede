"""Timelines: Chrome trace events and the PNG picture of a schedule, and of the ring attention's steps."""
import json
import struct
import zlib

import torch

from autoshard.parallel.comm import SIMULATED
from autoshard.parallel.context_parallel import context_positions
from autoshard.parallel.ring_attention import ring_attention
from autoshard.parallel.ring_steps import recording
from autoshard.runtime.schedules import Action, check, interleaved_1f1b
from autoshard.runtime.trace import RING_BLOCK, RING_EXCHANGE, ActionRecord, chrome_trace, export_trace, records_of, \
    ring_records


def _read_png(path):
    data = open(path, "rb").read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, size = 8, b"", None
    while pos < len(data):
        n, tag = struct.unpack(">I4s", data[pos: pos + 8])
        body = data[pos + 8: pos + 8 + n]
        assert struct.unpack(">I", data[pos + 8 + n: pos + 12 + n])[0] == zlib.crc32(tag + body)
        if tag == b"IHDR":
            size = struct.unpack(">II", body[:8])
        elif tag == b"IDAT":
            idat += body
        pos += 12 + n
    w, h = size
    raw = zlib.decompress(idat)
    rows = [raw[y * (3 * w + 1) + 1: (y + 1) * (3 * w + 1)] for y in range(h)]
    return w, h, lambda x, y: tuple(rows[y][3 * x: 3 * x + 3])


def test_chrome_trace_and_png_of_interleaved_schedule(tmp_path):
    pp, v, m = 4, 2, 8
    records = records_of(check(interleaved_1f1b(pp, v, m), v, m), seconds_per_unit=1e-3)
    trace = chrome_trace(records)
    boxes = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(boxes) == 2 * pp * v * m
    assert {e["pid"] for e in boxes} == set(range(pp))
    first = min((e for e in boxes if e["pid"] == 0), key=lambda e: e["ts"])
    assert first["name"] == "F mb0" and first["dur"] == 1000.0 and first["args"]["stage"] == 0
    export_trace(records, str(tmp_path / "sched"))
    assert json.load(open(tmp_path / "sched.json")) == trace
    w, h, pixel = _read_png(tmp_path / "sched.png")
    assert (w, h) == (1200, 4 * 28 + 8)
    unit = (w - 8) / max(r.end for r in records) * 1e-3     # pixels per schedule step
    mid = lambda r: 4 + r * 28 + 4                   # noqa: E731  (a row's top edge, clear of the label)
    assert pixel(5, mid(0)) == (66, 133, 244)        # rank 0 starts with a forward of chunk 0
    assert pixel(5, mid(3)) == (255, 255, 255)       # rank 3 waits three steps: the bubble
    assert pixel(int(4 + 3.5 * unit), mid(3)) == (66, 133, 244)


def test_ring_steps_are_drawn_overlapping_their_compute(tmp_path):
    """cp > 1: a ring call's steps, recorded as the rings run them, become block and exchange events
    on threads of their own and bars along the top of the row; overlapped, each exchange spans its
    step's compute. Nothing is recorded outside `recording`."""
    cp, seq = 3, 12
    q, k, v = (torch.randn(1, 2, seq // cp, 4, requires_grad=True) for _ in range(3))
    positions = [context_positions(seq, cp, r) for r in range(cp)]
    steps = []
    with recording(steps):
        outs = ring_attention(SIMULATED, [q] * cp, [k] * cp, [v] * cp, positions, None, scale=0.5, causal=True)
        sum(o.sum() for o in outs).backward()
    ring_attention(SIMULATED, [q] * cp, [k] * cp, [v] * cp, positions, None, scale=0.5, causal=True)   # not recorded
    forward = [s for s in steps if not s.backward]
    assert [s.step for s in forward] == list(range(cp)) and [s.step for s in steps if s.backward] == list(range(cp))
    assert [s.exchange is None for s in forward] == [False] * (cp - 1) + [True]
    for s in steps:
        if s.exchange is not None:
            assert s.exchange[0] <= s.compute[0] and s.exchange[1] >= s.compute[1]
    t0 = steps[0].compute[0]
    records = [ActionRecord(0, 0, 0, Action("F", 0, 0), 0.0, steps[-1].exchange[1] - t0)] + ring_records(steps, 0, 0, t0)
    events = [e for e in chrome_trace(records)["traceEvents"] if e.get("cat") == "ring"]
    assert len(events) == 4 * cp - 1
    assert {e["name"] for e in events} >= {"ring forward block 0", "ring forward exchange 0", "ring backward exchange 2"}
    assert sum(r.action.kind == RING_EXCHANGE for r in records) == 2 * cp - 1
    assert sum(r.action.kind == RING_BLOCK for r in records) == 2 * cp
    export_trace(records, str(tmp_path / "ring"))
    w, _, pixel = _read_png(tmp_path / "ring.png")
    assert pixel(5, 4 + 1) == (142, 68, 173)         # the first exchange, launched with the first block
    assert pixel(5, 4 + 3) == (0, 150, 136)          # ... which computes below it
