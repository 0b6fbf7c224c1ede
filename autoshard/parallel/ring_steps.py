"""The ring attention's steps: the loop both ring forms run, and its record for the trace.

`ring_loop` is the ring's step skeleton, forward and backward, for both ring forms (ring_attention.py
and ring_pieces.py): it yields the key/value blocks held at each of the cp steps, the caller
computing with them in its loop body; with `overlap` the next blocks are sent before that compute
and waited for after it, else sent after it. Backward's travelling dk / dv (`travelling`, updated in
place by the body) follow their block one step on after every compute, so after the last step they
are home.

While `recording(sink)` is active (MeshRuntime's training step at cp > 1), every step of every ring
attention call, forward and backward, appends a `RingStep` to `sink`: when the step's block compute
started and ended, and when its point-to-point exchange was launched and its blocks were in hand.
With overlap the exchange is launched before the compute and waited for after it, so the two spans
overlap; without, it follows the compute. Nothing is kept when no one records (the simulator, a
plain forward), and the clock is not read.
"""
from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass
from typing import Iterator

from autoshard.parallel.comm import Reducer

__all__ = ["RingStep", "recording", "ring_loop"]

_state = threading.local()     # per thread: each rank of a local world (world/local.py) records its own


@dataclass(frozen=True)
class RingStep:
    backward: bool
    step: int                                   # 0 .. cp - 1 within one ring call
    compute: tuple[float, float]                # time.time() at the block compute's start and end
    exchange: tuple[float, float] | None        # launch and arrival; None on forward's last step (no send)


def _sink() -> list["RingStep"] | None:
    return getattr(_state, "sink", None)


@contextlib.contextmanager
def recording(sink: list[RingStep]) -> Iterator[None]:
    """Ring steps run inside the block are appended to `sink`."""
    previous, _state.sink = _sink(), sink
    try:
        yield
    finally:
        _state.sink = previous


def ring_loop(red: Reducer, blocks: list[tuple], cp: int, overlap: bool,
              travelling: list[tuple] | None = None) -> Iterator[list[tuple]]:
    """Each rank's blocks at each of the cp steps (see the module doc). `travelling` (backward):
    per rank, the gradients of the block it holds, sent on with the block after each step."""
    backward = travelling is not None
    for step in range(cp):
        started = time.time() if _sink() is not None else 0.0
        pending = red.shift(blocks) if step < cp - 1 and overlap else None
        yield blocks
        computed = time.time() if _sink() is not None else 0.0
        if backward:
            travelling[:] = [tuple(g) for g in red.shift(travelling).wait()]
        if step < cp - 1:
            blocks = pending.wait() if pending is not None else red.shift(blocks).wait()
        if _sink() is not None:
            exchanged = backward or step < cp - 1
            launched = started if overlap else computed
            _sink().append(RingStep(backward, step, (started, computed), (launched, time.time()) if exchanged else None))
