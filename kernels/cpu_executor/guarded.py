"""Kernel arguments in mappings of their own between inaccessible pages: the CPU executor's
out-of-bounds check."""
from __future__ import annotations

import ctypes
import mmap

import numpy as np
import torch

from autoshard.kernels.cpu_executor.config import KernelExecutionError

__all__ = ["Guarded"]

_PAGE = mmap.PAGESIZE


def _canary(dtype: torch.dtype, argument: int) -> np.ndarray:
    """One element of slack fill for the `argument`-th tensor: a quiet NaN whose payload names the
    argument, so a read poisons what it reaches and a write of a value computed from another
    argument's slack still shows; bytes 0xa5 for integer tensors."""
    if dtype == torch.float32:
        return np.array([0x7FC00000 | 0x5A00 | (argument + 1)], dtype=np.uint32)
    if dtype == torch.float16:
        return np.array([0x7E00 | 0x100 | (argument + 1)], dtype=np.uint16)
    if dtype == torch.bfloat16:
        return np.array([0x7FC0 | ((argument + 1) & 0x3F)], dtype=np.uint16)
    return np.full(torch.empty((), dtype=dtype).element_size(), 0xA5, dtype=np.uint8)


class Guarded:
    """A tensor's bytes (from its first element to its last, strides included) in a mapping of
    their own between two inaccessible pages, at the address the tensor has modulo 16 (so a
    16-byte access is as aligned as on the tensor itself), as close as that allows to the guard
    page at one end. The slack around it (under 16 bytes on the guarded side, the rest of the page
    on the other) holds `_canary` elements: a read there poisons the result, a write there is
    found after the launch, an access beyond faults."""

    def __init__(self, lib: ctypes.CDLL, t: torch.Tensor, at_end: bool, argument: int):
        if any(s < 0 for s in t.stride()):
            raise KernelExecutionError(f"a tensor with negative strides {t.stride()} cannot be a kernel argument")
        self.tensor, self.lib, self.argument = t, lib, argument
        self.nbytes = (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))) * t.element_size() if t.numel() else 0
        length = ctypes.c_size_t()
        base = lib.emu_map_guarded(self.nbytes + 16, ctypes.byref(length))
        if not base:
            raise MemoryError(f"no mapping for a {self.nbytes}-byte kernel argument")
        self.base, self.length = base, length.value
        self.data, self.data_end = base + _PAGE, base + length.value - _PAGE
        offset = t.data_ptr() % 16
        if at_end:
            self.ptr = (self.data_end - self.nbytes - offset) // 16 * 16 + offset
        else:
            self.ptr = self.data + offset
        element = _canary(t.dtype, argument).tobytes()
        self.before = element * ((self.ptr - self.data) // len(element))
        self.after = element * ((self.data_end - self.ptr - self.nbytes) // len(element))
        ctypes.memmove(self.data, self.before, len(self.before))
        ctypes.memmove(self.ptr + self.nbytes, self.after, len(self.after))
        ctypes.memmove(self.ptr, t.data_ptr(), self.nbytes)

    def slack_written(self) -> str | None:
        """Which slack bytes around the tensor a launch changed, if any."""
        before = ctypes.string_at(self.data, len(self.before))
        after = ctypes.string_at(self.ptr + self.nbytes, len(self.after))
        hit = [len(before) - i for i, (a, b) in enumerate(zip(before, self.before)) if a != b]
        if hit:
            return f"a write {hit[0]} bytes before its start"
        hit = [i for i, (a, b) in enumerate(zip(after, self.after)) if a != b]
        return f"a write at byte {hit[0]} past its end" if hit else None

    def span(self) -> tuple[int, int]:
        """The tensor's own bytes [first, last + 1) in its storage."""
        start = self.tensor.data_ptr()
        return start, start + self.nbytes

    def copy_back(self) -> None:
        ctypes.memmove(self.tensor.data_ptr(), self.ptr, self.nbytes)

    def free(self) -> None:
        self.lib.emu_free(self.base, self.length)

    def describe(self, address: int) -> str | None:
        """Where `address` lies relative to this argument, if inside its mapping."""
        if not self.base <= address < self.base + self.length:
            return None
        offset = address - self.ptr
        side = f"{offset - self.nbytes} bytes past its end" if offset >= self.nbytes else f"{-offset} bytes before its start"
        return f"{side} ({self.what()})"

    def what(self) -> str:
        return (f"a {tuple(self.tensor.shape)} {str(self.tensor.dtype).removeprefix('torch.')} tensor of "
                f"{self.nbytes} bytes")
