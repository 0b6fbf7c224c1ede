"""Host-clock timing shared by the benchmark scripts: the device synchronized around each call."""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(fn: Callable[[], object], device: torch.device, reps: int) -> float:
    """Median wall time of `reps` calls of `fn`, each between two synchronizations of `device`."""
    times = []
    for _ in range(reps):
        _sync(device)
        t = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t)
    return statistics.median(times)
