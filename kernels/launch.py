"""How the fused ops' kernels run: a launch (`run_kernel`) of a kernel of kernels/cuda/ through CuPy on
torch's current stream, or, for CPU tensors while the CPU executor is on (kernels/cpu_executor/),
the same kernel on the CPU through the same code (pack choice, strides, grid sizing), and the
helpers each op's launch (kernels/fused/) uses to prepare its buffers.

Tensors cross to CuPy as bare device pointers (`data_ptr()`, offset included; absent optional
tensors are null pointers), refused unless on the launch's device (`kernel_arg`), and the kernel is
queued on torch's current stream, passed to the launch as a CuPy stream object cached per stream: no
CuPy array is made per argument and no current stream or device is switched (unless the tensors'
device is not the current one), so nothing waits across streams and a launch works under CUDA graph
capture. (A DLPack array per argument, as before, took most of a launch's host time:
kernels/NOTES.md.) Element-wise kernels take 16-byte packs when the last dim and every pointer allow
(`vec`), row kernels one block per row. Which calls reach these functions, and when the torch
implementation runs instead, is kernels/dispatch.py's business. `poisoned_outputs()` fills every
buffer a kernel writes with NaN first, so a test sees any element a kernel leaves unwritten.
"""
from __future__ import annotations

import contextlib
import functools
from collections import Counter
from collections.abc import Iterator

import numpy as np
import torch

from autoshard.kernels import cpu_executor
from autoshard.kernels.build import function

__all__ = ["poisoned_outputs", "LAUNCHES", "KERNEL_DTYPES", "THREADS", "kernel_arg", "run_kernel", "empty", "empty_like",
           "contiguous", "vec", "rows_view", "elementwise_blocks", "sm_count"]

THREADS = 256
KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_POISON = False
LAUNCHES: Counter[str] = Counter()      # kernel name -> launches (tests: the kernel ran, not the fallback)


@contextlib.contextmanager
def poisoned_outputs() -> Iterator[None]:
    """Within the block, every output buffer the kernels write starts as NaN (checks, not speed)."""
    global _POISON
    before, _POISON = _POISON, True
    try:
        yield
    finally:
        _POISON = before


def empty(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    t = torch.empty(shape, dtype=dtype, device=device)
    return t.fill_(float("nan")) if _POISON else t


def empty_like(t: torch.Tensor) -> torch.Tensor:
    return empty(t.shape, t.dtype, t.device)


def kernel_arg(a, device: torch.device):
    """A kernel argument for CuPy: a tensor as its device pointer (the kernels take `T*`), None as a
    null pointer, scalars as they are. A tensor on another device than the launch's is refused: its
    pointer would be read as this device's memory."""
    if isinstance(a, torch.Tensor):
        if a.device != device:
            raise ValueError(f"kernel argument on {a.device}, the launch on {device}: every tensor of a "
                             f"launch must be on its device")
        return np.uint64(a.data_ptr())
    return np.uint64(0) if a is None else a


def _aligned(*ts: torch.Tensor | None) -> bool:
    return all(t is None or t.data_ptr() % 16 == 0 for t in ts)


def vec(cols: int, x: torch.Tensor, *ts: torch.Tensor | None, strides: tuple[int, ...] = ()) -> int:
    """1 when rows of `cols` elements (and every row stride) are whole 16-byte packs of x's dtype and
    every pointer is 16-byte aligned."""
    n = 16 // x.element_size()
    return int(all(v % n == 0 for v in (cols, *strides)) and _aligned(x, *ts))


@functools.cache
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(like: torch.Tensor) -> int:
    """The device's multiprocessor count, or the CPU executor's stand-in for it."""
    if like.is_cuda:
        return _cuda_sm_count(like.device.index)
    return (cpu_executor.active() or cpu_executor.Config()).sm_count


_STREAMS: dict[int, object] = {}        # torch stream pointer -> CuPy's ExternalStream for it


def _cupy_stream(pointer: int):
    stream = _STREAMS.get(pointer)
    if stream is None:
        import cupy
        stream = _STREAMS[pointer] = cupy.cuda.ExternalStream(pointer)
    return stream


def _launch_cuda(name: str, dtype_name: str, device: torch.device, grid: int, threads: int, args: tuple) -> None:
    """Queue the kernel on torch's current stream of `device`, whose memory every tensor is in."""
    import cupy
    kernel = function(name, dtype_name)
    stream = _cupy_stream(torch.cuda.current_stream(device).cuda_stream)
    values = tuple(kernel_arg(a, device) for a in args)
    if cupy.cuda.runtime.getDevice() == device.index:
        kernel((grid,), (threads,), values, stream=stream)
    else:
        with cupy.cuda.Device(device.index):       # the kernel is loaded per device: pick this one's
            kernel((grid,), (threads,), values, stream=stream)


def run_kernel(name: str, like: torch.Tensor, blocks: int, args: tuple, threads: int = THREADS) -> None:
    """Launch `name<like's dtype>` with at most 32 blocks per SM (the kernels stride over the rest):
    on torch's current stream, or for a CPU tensor on the CPU executor."""
    grid = max(1, min(blocks, sm_count(like) * 32))
    dtype_name = str(like.dtype).removeprefix("torch.")
    if like.is_cuda:
        _launch_cuda(name, dtype_name, like.device, grid, threads, args)
    else:
        cpu_executor.launch(name, dtype_name, grid, threads, args)
    LAUNCHES[name] += 1


def elementwise_blocks(n: int) -> int:
    return (n + THREADS - 1) // THREADS


def contiguous(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.contiguous()


def rows_view(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """t as [rows, cols] and its row stride; a view when possible (two halves of a [.., 2n] tensor
    stay views with stride 2n)."""
    v = t.reshape(-1, t.shape[-1])
    if v.stride(-1) != 1:
        v = v.contiguous()
    return v, v.stride(0)
