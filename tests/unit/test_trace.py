"""Timelines: Chrome trace events and the PNG picture of a schedule."""
import json
import struct
import zlib

from autoshard.runtime.schedules import check, interleaved_1f1b
from autoshard.runtime.trace import chrome_trace, export_trace, records_of


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
