"""A built CPU executor: its kernels and their parameters, read from the library itself, and
launches that check every argument against them the way the CUDA launch fixes them."""
from __future__ import annotations

import ctypes
import signal
from dataclasses import dataclass

import numpy as np
import torch

from autoshard.kernels.cpu_executor.config import SCHEDULES, KernelExecutionError
from autoshard.kernels.cpu_executor.guarded import Guarded

__all__ = ["Library"]


@dataclass(frozen=True)
class _Param:
    size: int
    kind: str           # 'c' read-only pointer, 'p' writable pointer, 'f' float, 'i' integer


_SIGNALS = {signal.SIGSEGV: "SIGSEGV", signal.SIGBUS: "SIGBUS", signal.SIGILL: "SIGILL", signal.SIGFPE: "SIGFPE"}


class Library:
    """The built executor: kernel names ('bias_gelu_fwd<f16>') to their parameters, and launches."""

    def __init__(self, lib: ctypes.CDLL):
        self.lib = lib
        lib.emu_kernel_name.restype = ctypes.c_char_p
        lib.emu_map_guarded.restype = ctypes.c_void_p
        lib.emu_map_guarded.argtypes = [ctypes.c_size_t, ctypes.c_void_p]
        lib.emu_free.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        for conversion in ("emu_to_half", "emu_to_bf16", "emu_from_half"):
            getattr(lib, conversion).argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long]
        lib.emu_launch.argtypes = [ctypes.c_int, ctypes.c_uint, ctypes.c_uint, ctypes.c_void_p, ctypes.c_int,
                                   ctypes.c_char_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
        self.kernels: dict[str, tuple[int, tuple[_Param, ...]]] = {}
        for k in range(lib.emu_kernel_count()):
            params = []
            for p in range(lib.emu_kernel_arity(k)):
                size = ctypes.c_int()
                kind = lib.emu_kernel_param(k, p, ctypes.byref(size))
                params.append(_Param(size.value, chr(kind)))
            self.kernels[lib.emu_kernel_name(k).decode()] = (k, tuple(params))

    def _marshal(self, name: str, params: tuple[_Param, ...], args: tuple, guard: str, guarded: list) -> list:
        """The arguments as ctypes values, each checked against its parameter; tensors copied into
        guarded mappings, appended to `guarded` with whether the kernel may write them."""
        if len(args) != len(params):
            raise KernelExecutionError(f"{name} takes {len(params)} arguments, the launch passed {len(args)}")
        values = []
        for i, (a, p) in enumerate(zip(args, params)):
            if p.kind in "cp":
                if a is None:
                    values.append(ctypes.c_void_p(None))
                elif isinstance(a, torch.Tensor) and a.device.type == "cpu":
                    g = Guarded(self.lib, a, guard == "end", i)
                    guarded.append((g, p.kind == "p"))
                    values.append(ctypes.c_void_p(g.ptr))
                else:
                    raise KernelExecutionError(f"{name} argument {i}: a pointer parameter takes a CPU tensor or "
                                               f"None, got {type(a).__name__}")
                continue
            if not isinstance(a, np.generic):
                raise KernelExecutionError(f"{name} argument {i}: pass a numpy scalar of {p.size} bytes (the CUDA "
                                           f"launch fixes each argument's size), got {type(a).__name__} {a!r}")
            kind = "f" if isinstance(a, np.floating) else "i" if isinstance(a, np.integer) else "?"
            if a.nbytes != p.size or kind != p.kind:
                raise KernelExecutionError(
                    f"{name} argument {i}: the parameter is a {p.size}-byte {'float' if p.kind == 'f' else 'integer'}, "
                    f"the launch passed {a.dtype} ({a.nbytes} bytes)")
            values.append(np.ctypeslib.as_ctypes(np.array(a)))
        for g, writable in guarded:         # each argument is copied: an output aliasing another would diverge
            for h, _ in guarded:
                lo, hi = g.span()
                if writable and h is not g and lo < h.span()[1] and h.span()[0] < hi:
                    raise KernelExecutionError(f"{name}: argument {g.argument}, which the kernel writes, overlaps "
                                               f"argument {h.argument} (the executor copies each argument)")
        return values

    def launch(self, name: str, grid: int, block: int, args: tuple, schedule: str = "lockstep",
               guard: str = "end") -> None:
        """Run `name` (e.g. 'norm_fwd<bf16>') over `grid` blocks of `block` threads on `args` as the
        CuPy launch takes them; raise KernelExecutionError on a fault, deadlock or wrong argument."""
        if name not in self.kernels:
            raise KeyError(f"no kernel {name!r} in the CPU executor; known: {', '.join(sorted(self.kernels))}")
        index, params = self.kernels[name]
        guarded: list[tuple[Guarded, bool]] = []
        try:
            values = self._marshal(name, params, args, guard, guarded)
            pointers = (ctypes.c_void_p * max(1, len(values)))(*(ctypes.cast(ctypes.pointer(v), ctypes.c_void_p)
                                                               for v in values))
            err, sig, addr = ctypes.create_string_buffer(512), ctypes.c_int(), ctypes.c_void_p()
            status = self.lib.emu_launch(index, grid, block, pointers, SCHEDULES.index(schedule), err, len(err),
                                         ctypes.byref(sig), ctypes.byref(addr))
            what = f"{name} (grid {grid}, block {block}, {schedule})"
            if status == 1:
                raise KernelExecutionError(f"{what}: {err.value.decode()}")
            if status == 2:
                raise KernelExecutionError(f"{what}: {self._fault(sig.value, addr.value or 0, guarded)} at "
                                           f"{err.value.decode()}")
            for g, _ in guarded:
                slack = g.slack_written()
                if slack:
                    raise KernelExecutionError(f"{what}: out-of-bounds write: {slack} of argument {g.argument} "
                                               f"({g.what()})")
            for g, writable in guarded:
                if writable:
                    g.copy_back()
        finally:
            for g, _ in guarded:
                g.free()

    @staticmethod
    def _fault(sig: int, address: int, guarded: list) -> str:
        name = _SIGNALS.get(sig, f"signal {sig}")
        if sig == signal.SIGILL:
            return f"{name}: a trap, the alignment check's (a misaligned access) or another"
        for g, _ in guarded:
            where = g.describe(address)
            if where is not None:
                return f"{name}: out-of-bounds access {where}, argument {g.argument}"
        return f"{name} at address {address:#x} (outside every argument)"
