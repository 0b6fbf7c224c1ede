"""The first launch of each fused op, dtype, device, variant (its flags: approximate, causal, rms,
inverse, and which optional tensors it gets: a mask, biases) and layout (each tensor dense,
broadcast, strided or misaligned) in a process is checked: the kernel runs on the call's own
operands, the op's torch implementation too, and they are compared. On a match the kernel's result
is returned and later calls of that key run the kernel alone; on a mismatch, or if the kernel
raises, the torch implementation's result is returned, and the kernel is disabled for that key
with a warning naming it and the error.

The check runs on the call's operands rather than a sample of its own so that it sees what the
kernel will see: the shapes, the broadcast operands, the offsets and strides of this call
(a fixed sample of full, dense operands cannot show a slot read wrongly).

On by default on a GPU; `AUTOSHARD_KERNEL_SELF_CHECK=0` turns it off. On the CPU executor it runs
only when its Config asks (self_check=True): the executor's own tests plant bugs that must show.
"""
from __future__ import annotations

import os
import time
import warnings
from collections.abc import Callable

import torch

from autoshard.kernels import cpu_executor

__all__ = ["checked", "variant_of", "TOLERANCE", "RESULTS", "reset"]

# norm-relative difference kernel vs torch implementation allowed per storage dtype: both compute
# in fp32 and round once, so they differ by at most an ulp of the storage type here and there
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
# (op, dtype, device, variant) -> (passed, seconds); the variant is the call's flags (a string or a
# bool: approximate, causal, rms, inverse), which optional tensors it passes (a mask, biases) and
# each tensor's layout class
RESULTS: dict[tuple[str, torch.dtype, str, tuple], tuple[bool, float]] = {}


def reset() -> None:
    """Forget every check (tests)."""
    RESULTS.clear()


def _wanted(device: torch.device) -> bool:
    if os.environ.get("AUTOSHARD_KERNEL_SELF_CHECK", "1") == "0":
        return False
    if device.type == "cpu":
        config = cpu_executor.active()
        return config is not None and config.self_check
    return True


def _flat(out) -> list[torch.Tensor]:
    return list(out) if isinstance(out, (tuple, list)) else [out]


_CHUNK = 1 << 24                    # elements widened to float64 at a time (128 MiB), on the tensor's device


def _pieces(t: torch.Tensor):
    flat = t.detach().reshape(-1)
    for i in range(0, flat.numel(), _CHUNK):
        yield flat[i:i + _CHUNK].double()


def _largest(call: tuple) -> float:
    """The largest finite magnitude among the call's floating-point tensors."""
    return max((float(p.nan_to_num(0.0, 0.0, 0.0).abs().max()) for t in call
                if isinstance(t, torch.Tensor) and t.is_floating_point() for p in _pieces(t)), default=0.0)


def _difference(got, want, inputs: float) -> float:
    """The kernel's results against the torch implementation's, norm-wise, over the larger of the
    latter's norm and sqrt(n) times the inputs' largest magnitude: an output small by cancellation
    (softmax's backward of a constant gradient) is judged by the size of what cancelled, not by its
    own rounding. Elements equal in both (an infinity, NaN from a NaN input) agree; a NaN in the
    kernel's alone (an unwritten element) fails. Float64 a chunk at a time, on the device."""
    worst = 0.0
    for g, w in zip(_flat(got), _flat(want)):
        if g.shape != w.shape:
            return float("inf")
        off = norm = 0.0
        for a, b in zip(_pieces(g), _pieces(w)):
            off += float(torch.where((a == b) | (a.isnan() & b.isnan()), 0.0, a - b).square().sum())
            norm += float(torch.where(b.isfinite(), b, 0.0).square().sum())
        err = off ** 0.5 / max(norm ** 0.5, w.numel() ** 0.5 * inputs, 1e-30)
        worst = max(worst, err if err == err else float("inf"))
    return worst


def _layout(t: torch.Tensor) -> str:
    """A tensor's layout class, what decides a launch's code path besides its shape: a broadcast
    (stride-0) dim, strides that are not contiguous (transposed, sliced), a start off 16 bytes."""
    if t.dim() == 0:
        return "scalar"
    kinds = []
    if t.is_contiguous():           # the common case first: no stride of 0 over a dim of more than one
        pass
    elif any(st == 0 and n > 1 for st, n in zip(t.stride(), t.shape)):
        kinds.append("broadcast")
    else:
        kinds.append("strided")
    if t.data_ptr() % 16:
        kinds.append("misaligned")
    return "+".join(kinds) or "dense"


def variant_of(args: tuple) -> tuple:
    """What selects a kernel's code path: flags, whether each optional tensor is there and its
    layout (sizes, seeds, probabilities and scales do not; each slot's shape is fixed by the
    dispatch table)."""
    def one(a) -> object:
        if isinstance(a, (bool, str)):
            return a
        if a is None:
            return "none"
        if not isinstance(a, torch.Tensor):
            return "number"
        layout = _layout(a)
        return "tensor" if layout == "dense" else "tensor:" + layout
    return tuple(one(a) for a in args)


def checked(name: str, args: tuple, kernel: Callable[[], object], reference: Callable, call: tuple,
            variant: tuple | None = None) -> object:
    """Op `name` on `call` (the call's arguments; `args`, the kernel's): `kernel()` where its check
    for this key passed (or is off), else `reference(*call)`. The first call of a key runs both and
    compares (module doc)."""
    first = args[0]
    key = (name, first.dtype, str(first.device), variant_of(args) if variant is None else variant)
    if key in RESULTS:
        return kernel() if RESULTS[key][0] else reference(*call)
    if not _wanted(first.device):
        return kernel()
    if first.is_cuda and torch.cuda.is_current_stream_capturing():
        return kernel()         # no check inside CUDA graph capture (it syncs); the next eager call checks
    start = time.perf_counter()
    got = None
    try:
        got = kernel()
    except Exception as e:          # a kernel that cannot run here must not stop training
        problem = f"it raised {type(e).__name__}: {e}"
    want = reference(*call)
    if got is not None:
        err = _difference(got, want, _largest(call))
        problem = None if err <= TOLERANCE[first.dtype] else (
            f"relative difference {err:.2e} > {TOLERANCE[first.dtype]:.0e} from its torch implementation")
    RESULTS[key] = (problem is None, time.perf_counter() - start)
    if problem:
        dtype = str(first.dtype).removeprefix("torch.")
        warnings.warn(f"autoshard: the {name} kernel for {dtype} on {first.device} failed its first-use check "
                      f"({problem}); it is disabled in this process and the torch implementation runs. "
                      f"AUTOSHARD_KERNEL_SELF_CHECK=0 skips the check.", RuntimeWarning, stacklevel=3)
        return want
    return got
