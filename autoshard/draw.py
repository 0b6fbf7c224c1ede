"""Draw a pipeline schedule: `python -m autoshard.draw --pp 4 --chunks 2 --microbatches 8 --out docs/x`.

Prints the unit-cost timeline as text and its bubble, and with --out writes a Chrome trace (.json)
and a picture (.png) of it.
"""
from __future__ import annotations

import argparse

from .schedules import SCHEDULES, bubble_fraction, check, make_schedule
from .trace import export_trace, records_of, text_timeline


def main() -> None:
    ap = argparse.ArgumentParser(description="Draw a pipeline schedule (unit action costs).")
    ap.add_argument("--pp", type=int, default=4)
    ap.add_argument("--chunks", type=int, default=2, help="virtual chunks per rank")
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--schedule", choices=SCHEDULES, default="interleaved")
    ap.add_argument("--out", default=None, help="write OUT.json (Chrome trace) and OUT.png")
    args = ap.parse_args()
    timeline = check(make_schedule(args.schedule, args.pp, args.chunks, args.microbatches), args.chunks,
                     args.microbatches)
    print(text_timeline(timeline))
    print(f"bubble: {bubble_fraction(timeline):.4f} of ideal time "
          f"((p - 1) / (v m) = {(args.pp - 1) / (args.chunks * args.microbatches):.4f})")
    if args.out:
        export_trace(records_of(timeline, 1e-3), args.out)


if __name__ == "__main__":
    main()
