"""The CPU executor's settings, and the switch that makes CPU tensors run the CUDA kernels: a
context manager, or AUTOSHARD_CUDA_ON_CPU=1 (or =run-ahead) for a whole process."""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from autoshard.kernels.build import KERNELS

__all__ = ["Config", "SCHEDULES", "active", "enabled", "KernelExecutionError", "ExecutorUnavailable"]

SCHEDULES = ("lockstep", "run-ahead")


class ExecutorUnavailable(RuntimeError):
    """No host C++ compiler: the executor cannot be built here."""


class KernelExecutionError(RuntimeError):
    """A kernel faulted (out of bounds, misaligned), deadlocked, or was launched with wrong arguments."""


@dataclass(frozen=True)
class Config:
    schedule: str = "lockstep"          # "lockstep" or "run-ahead" (executor.cpp says what each does)
    sm_count: int = 2                   # what the launch code reads as the device's SM count (grid sizes)
    guard: str = "end"                  # the inaccessible page after each tensor ("end") or before it ("start")
    self_check: bool = False            # launch.py's first-use check, as on a GPU (off: tests plant bugs)
    sources: Mapping[str, str] = field(default_factory=dict)    # file -> replacement text (planted bugs)

    def __post_init__(self):
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if self.guard not in ("end", "start"):
            raise ValueError(f"guard must be 'end' or 'start', got {self.guard!r}")
        if not (isinstance(self.sm_count, int) and self.sm_count >= 1):
            raise ValueError(f"sm_count must be a positive integer, got {self.sm_count!r}")
        unknown = set(self.sources) - set(KERNELS) - {"common.cuh"}
        if unknown:
            raise ValueError(f"sources names unknown files {sorted(unknown)}; known: common.cuh, {', '.join(KERNELS)}")


def _from_environment() -> Config | None:
    value = os.environ.get("AUTOSHARD_CUDA_ON_CPU", "")
    if value in ("", "0"):
        return None
    return Config(schedule="run-ahead" if value == "run-ahead" else "lockstep")


_ACTIVE: Config | None = _from_environment()


def active() -> Config | None:
    """The executor's settings while CPU tensors run the CUDA kernels, else None."""
    return _ACTIVE


@contextlib.contextmanager
def enabled(**settings) -> Iterator[Config]:
    """Within the block the fused ops run their CUDA kernels on CPU tensors (Config's fields)."""
    global _ACTIVE
    before, _ACTIVE = _ACTIVE, Config(**{"sources": {}, **settings})
    try:
        yield _ACTIVE
    finally:
        _ACTIVE = before
