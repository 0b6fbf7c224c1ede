"""The ring attention's steps as they ran, for the trace (runtime/trace.py draws them).

While `recording(sink)` is active (MeshRuntime's training step at cp > 1), every step of every ring
attention call, forward and backward, appends a `RingStep` to `sink`: when the step's block compute
started and ended, and when its point-to-point exchange was launched and its blocks were in hand.
With overlap the exchange is launched before the compute and waited for after it, so the two spans
overlap; without, it follows the compute. Nothing is kept when no one records (the simulator, a
plain forward), and the clock is not read.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Iterator

__all__ = ["RingStep", "StepClock", "recording"]

_sink: list["RingStep"] | None = None


@dataclass(frozen=True)
class RingStep:
    backward: bool
    step: int                                   # 0 .. cp - 1 within one ring call
    compute: tuple[float, float]                # time.time() at the block compute's start and end
    exchange: tuple[float, float] | None        # launch and arrival; None on forward's last step (no send)


@contextlib.contextmanager
def recording(sink: list[RingStep]) -> Iterator[None]:
    """Ring steps run inside the block are appended to `sink`."""
    global _sink
    previous, _sink = _sink, sink
    try:
        yield
    finally:
        _sink = previous


class StepClock:
    """Times one ring loop: `start()` before a step's sends, `computed()` after its compute,
    `done(step, exchanged)` once what it received is in hand."""

    def __init__(self, backward: bool, overlap: bool):
        self.backward, self.overlap = backward, overlap
        self._started = self._computed = 0.0

    def start(self) -> None:
        if _sink is not None:
            self._started = time.time()

    def computed(self) -> None:
        if _sink is not None:
            self._computed = time.time()

    def done(self, step: int, exchanged: bool) -> None:
        if _sink is None:
            return
        launched = self._started if self.overlap else self._computed
        _sink.append(RingStep(self.backward, step, (self._started, self._computed),
                              (launched, time.time()) if exchanged else None))
