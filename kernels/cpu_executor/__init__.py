"""The CUDA kernels of kernels/cuda/, run on the CPU: the same sources compiled by the host C++
compiler against kernels/cpu_executor/cuda_on_cpu.h, each block's threads run as fibers by
kernels/cpu_executor/executor.cpp, launched with the arguments the CuPy launch passes.

    from autoshard.kernels import cpu_executor
    with cpu_executor.enabled(schedule="run-ahead", sm_count=1):
        y = ops.bias_gelu(x, b)        # CPU tensors: the CUDA kernel runs, through launch.py's path

or `AUTOSHARD_CUDA_ON_CPU=1` (or `=run-ahead`) in the environment for a whole process.

What a launch checks: each argument against the kernel's parameter (a tensor or None for a
pointer, a numpy scalar of the parameter's size and kind for the rest); every tensor is copied into
its own mapping with an inaccessible page right after its last byte (`guard="end"`) or right
before its first (`guard="start"`), so an out-of-bounds access faults; the kernels are built with
g++'s alignment check (a misaligned 16-byte access traps); faults, deadlocks and divergent warp
exchanges come back as KernelExecutionError naming the kernel, block and thread. The library is
built once per source hash into the cache directory ($AUTOSHARD_KERNEL_CACHE, else
~/.cache/autoshard/cpu-kernels).

Files: config.py (the settings and the switch), build.py (compiling the sources into one library,
cached), library.py (a built library: argument checks and launches), guarded.py (the argument
mappings between guard pages), cuda_on_cpu.h and executor.cpp (the C++ side).
"""
from __future__ import annotations

from collections import Counter

from autoshard.kernels.build import STORAGE
from autoshard.kernels.cpu_executor.build import compiler, library
from autoshard.kernels.cpu_executor.config import (
    SCHEDULES,
    Config,
    ExecutorUnavailable,
    KernelExecutionError,
    active,
    enabled,
)
from autoshard.kernels.cpu_executor.library import Library

__all__ = ["Config", "enabled", "active", "library", "Library", "KernelExecutionError", "ExecutorUnavailable",
           "SCHEDULES", "compiler", "launch", "GRIDS"]

GRIDS: Counter[tuple[str, int, int]] = Counter()      # (kernel, grid, block) -> launches (tests: grid sizes)


def launch(name: str, dtype_name: str, grid: int, block: int, args: tuple) -> None:
    """launch.py's entry: `name<storage of dtype_name>` with the active settings."""
    config = active() or Config()
    library(config.sources).launch(f"{name}<{STORAGE[dtype_name]}>", grid, block, args, config.schedule,
                                   config.guard)
    GRIDS[(name, grid, block)] += 1
