"""The learning-rate schedule: linear warm-up to the peak, then a cosine decay to min_ratio x peak
at the last step (Megatron's "cosine" style). A function of the step alone, so a resumed run
continues it exactly."""
from __future__ import annotations

import math

__all__ = ["learning_rate"]


def learning_rate(step: int, *, peak: float, warmup: int, total: int, min_ratio: float) -> float:
    """The rate for step `step` (0-based) of `total`."""
    if step < warmup:
        return peak * (step + 1) / warmup
    floor = peak * min_ratio
    span = max(total - warmup, 1)
    progress = min((step - warmup) / span, 1.0)
    return floor + 0.5 * (peak - floor) * (1 + math.cos(math.pi * progress))
