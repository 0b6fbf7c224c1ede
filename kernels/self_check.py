"""The first launch of each fused op, dtype, device and variant (its flags: approximate, causal, rms,
inverse, and which optional tensors it gets: a mask, biases) in a process checks the kernel
against the op's torch implementation on a small random input with those flags. On a mismatch, or
if the kernel raises, the kernel is disabled for that op, dtype, device and variant with a warning
naming it and the error, and the torch implementation runs from then on.

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
from autoshard.kernels import reference as ref

__all__ = ["trusted", "TOLERANCE", "RESULTS", "reset"]

# norm-relative difference kernel vs torch implementation allowed per storage dtype: both compute
# in fp32 and round once, so they differ by at most an ulp of the storage type here and there
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
ROWS, COLS = 3, 40                  # 40: a tail after four 8-wide packs, so vector and scalar paths run
# (op, dtype, device, variant) -> (passed, seconds); the variant is the call's flags (a string or a
# bool: approximate, causal, rms, inverse) and which optional tensors it passes (a mask, biases)
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


def _small_args(name: str, args: tuple, dtype: torch.dtype, device: torch.device) -> tuple:
    """Fresh small inputs for op `name` in `dtype`, keeping the call's flags and which optional
    tensors it passes."""
    gen = torch.Generator(device).manual_seed(1234)

    def r(*shape, dt=dtype):
        return torch.randn(shape, generator=gen, device=device).to(dt)

    def opt(t, *shape):
        return None if t is None else r(*shape)

    if name == "bias_gelu":
        return r(ROWS, COLS), opt(args[1], COLS), args[2]
    if name == "bias_gelu_backward":
        return r(ROWS, COLS), r(ROWS, COLS), opt(args[2], COLS), args[3]
    if name == "swiglu":
        return r(ROWS, COLS), r(ROWS, COLS), opt(args[2], COLS), opt(args[3], COLS)
    if name == "swiglu_backward":
        return r(ROWS, COLS), r(ROWS, COLS), r(ROWS, COLS), opt(args[3], COLS), opt(args[4], COLS)
    if name == "scaled_masked_softmax":
        mask = None if args[1] is None else torch.rand((2, 5, 7), generator=gen, device=device) < 0.3
        return r(2, 2, 5, 7), mask, args[2], args[3]
    if name == "scaled_masked_softmax_backward":
        return r(2, 2, 5, 7), torch.softmax(r(2, 2, 5, 7, dt=torch.float32), -1).to(dtype), args[2]
    if name == "bias_dropout_add":
        return r(ROWS, COLS), opt(args[1], COLS), r(ROWS, COLS), args[3], args[4]
    if name == "bias_dropout_add_backward":
        return r(ROWS, COLS), args[1], args[2]
    if name == "norm":
        return r(ROWS, COLS), opt(args[1], COLS), opt(args[2], COLS), args[3], args[4]
    if name == "norm_backward":
        x, w = r(ROWS, COLS), opt(args[2], COLS)
        _, mean, rstd = ref.norm_fwd(x, w, None, 1e-5, args[5])
        return r(ROWS, COLS), x, w, mean, rstd, args[5]
    if name == "rotary":
        angles = torch.arange(5, device=device).float()[:, None] * torch.rand(4, generator=gen, device=device)
        angles = torch.cat([angles, angles], -1)[None]                         # [1, s, d]
        return r(1, 2, 5, 8), angles.cos(), angles.sin(), args[3], 4
    raise KeyError(f"no self-check input for op {name!r}")


def _flat(out) -> list[torch.Tensor]:
    return list(out) if isinstance(out, (tuple, list)) else [out]


def _difference(got, want) -> float:
    worst = 0.0
    for g, w in zip(_flat(got), _flat(want)):
        g, w = g.detach().double().cpu(), w.detach().double().cpu()
        err = ((g - w).norm() / w.norm().clamp_min(1e-30)).item()
        worst = max(worst, err if err == err else float("inf"))        # NaN (an unwritten element) fails
    return worst


def _variant(args: tuple) -> tuple:
    """What selects a kernel's code path: flags, and whether each optional tensor is there (sizes,
    seeds, probabilities and scales do not)."""
    return tuple(a if isinstance(a, (bool, str)) else "none" if a is None else "tensor" if isinstance(a, torch.Tensor)
                 else "number" for a in args)


def trusted(name: str, args: tuple, kernel: Callable[[tuple], object], reference: Callable) -> bool:
    """Whether op `name`'s kernel may run on `args` (by their first tensor's dtype and device):
    checked once per process on a small input built like `args`, `kernel(small)` against
    `reference(*small)`."""
    first = args[0]
    key = (name, first.dtype, str(first.device), _variant(args))
    if key in RESULTS:
        return RESULTS[key][0]
    if not _wanted(first.device):
        return True
    if first.is_cuda and torch.cuda.is_current_stream_capturing():
        return True             # no check inside CUDA graph capture (it syncs); the next eager call checks
    start = time.perf_counter()
    small = _small_args(name, args, first.dtype, first.device)
    try:
        err = _difference(kernel(small), reference(*small))
        problem = None if err <= TOLERANCE[first.dtype] else (
            f"relative difference {err:.2e} > {TOLERANCE[first.dtype]:.0e} from its torch implementation")
    except Exception as e:          # a kernel that cannot run here must not stop training
        problem = f"it raised {type(e).__name__}: {e}"
    RESULTS[key] = (problem is None, time.perf_counter() - start)
    if problem:
        dtype = str(first.dtype).removeprefix("torch.")
        warnings.warn(f"autoshard: the {name} kernel for {dtype} on {first.device} failed its first-use check "
                      f"({problem}); it is disabled in this process and the torch implementation runs. "
                      f"AUTOSHARD_KERNEL_SELF_CHECK=0 skips the check.", RuntimeWarning, stacklevel=3)
    return problem is None
