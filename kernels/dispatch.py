"""Which fused-op calls run a kernel: each op's entry (kernels/fused/, listed in kernels/ops.py)
names its launch function and what it reads in each argument slot; every other call (an operand of
another shape, an empty tensor, a dtype the kernels lack), a kernel that failed its first-use check
(kernels/self_check.py), and any CPU tensor while the CPU executor is off run the op's exact torch
implementation. `register` puts this in front of each custom op for CUDA tensors (when
CuPy imports) and for CPU tensors, and the autograd that calls it directly (kernels/eager_autograd.py)."""
from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from autoshard.kernels import cpu_executor, self_check
from autoshard.kernels.eager_autograd import eager_autograd
from autoshard.kernels.launch import KERNEL_DTYPES
from autoshard.kernels.reference import result_dtype

LIB = "autoshard"          # the custom ops' namespace: torch.ops.autoshard.* (kernels/ops.py)

__all__ = ["LIB", "FusedOp", "Kernel", "register", "FULL", "VECTOR", "ROWS", "MASK", "TABLE"]


# What a kernel reads in each tensor slot, given the first argument x (whose shape the kernel's
# output takes; a slot not named is passed as it is). Anything else falls back to the torch
# implementation, per call: a kernel indexes its buffers by these shapes and would read out of
# bounds (a [cols] vector where it reads a full tensor) or the wrong element (a full tensor where it
# reads a bias) without a word.
FULL = "full"          # x's shape exactly (any strides: the launch makes it contiguous)
VECTOR = "vector"      # [cols], cols = x's last dim
ROWS = "rows"          # fp32, x's shape less its last dim (a norm's saved mean and rstd)
MASK = "mask"          # [1 or batch, sq, sk] of scores x [batch, heads, sq, sk]; nonzero = masked
TABLE = "table"        # [1 or batch, s, d] of x [batch, heads, s, d] (rotary's cos and sin)


def _fits(kind: str, t: torch.Tensor, x: torch.Tensor) -> bool:
    if kind == FULL:
        return t.shape == x.shape
    if kind == VECTOR:
        return t.dim() == 1 and t.shape[0] == x.shape[-1]
    if kind == ROWS:
        return t.shape == x.shape[:-1] and t.dtype == torch.float32
    if kind in (MASK, TABLE):
        lead = x.shape[0]
        want = (x.shape[-2], x.shape[-1])
        return t.dim() == 3 and x.dim() == 4 and t.shape[0] in (1, lead) and tuple(t.shape[1:]) == want
    raise KeyError(kind)


class Kernel(NamedTuple):
    """How one custom op (a forward or a backward) runs its kernel: the launch (kernels/launch.py's
    `run_kernel` inside), what the kernel reads in each argument slot (above), whether inputs are
    converted to their promoted dtype (the element-wise ops compute in it like the `x + bias` they
    replace; else: one dtype or fall back), and a further test of the arguments."""
    impl: Callable
    slots: dict[int, str]           # argument index -> what the kernel reads there (above)
    promote: bool
    takes: Callable[[tuple], bool] | None = None


class FusedOp(NamedTuple):
    """A fused op's entry in kernels/ops.py's table: its kernel source (kernels/cuda/), a Kernel per
    custom op name (its forward and backward), and the custom ops themselves (kernels/fused/)."""
    source: str
    kernels: dict[str, Kernel]
    ops: tuple


_VALUES = (FULL, VECTOR)            # the slots that hold the op's values (dtype-converted with x)


def _kernel_args(args: tuple, slots: dict[int, str], promote: bool) -> tuple | None:
    """The arguments as the kernel reads them, or None where it cannot: x (the first) non-empty with
    at least one dim, every tensor slot as `slots` says (`_fits`), the value slots all of one
    fp32 / fp16 / bf16 dtype: x's, or with `promote` the promoted one they are converted to, and
    every tensor on x's device."""
    x = args[0]
    if x.dim() == 0 or x.numel() == 0:
        return None                                  # nothing to launch over: the torch path
    if any(isinstance(a, torch.Tensor) and a.device != x.device for a in args):
        return None                                  # a kernel reads one device's memory: torch's rules
    live = {i: kind for i, kind in slots.items() if args[i] is not None}
    if not all(_fits(kind, args[i], x) for i, kind in live.items()):
        return None
    values = [i for i, kind in live.items() if kind in _VALUES]
    dtype = result_dtype(x, *(args[i] for i in values)) if promote else x.dtype
    if dtype not in KERNEL_DTYPES or (not promote and any(args[i].dtype != dtype for i in values)):
        return None
    return _in_dtype(args, dtype, slots)


def _in_dtype(args: tuple, dtype: torch.dtype, slots: dict[int, str]) -> tuple:
    """x and the value slots given (not None) in `dtype`; a tensor already of it is passed as it is
    (`.to` would only cost the call)."""
    return tuple(a.to(dtype) if (i == 0 or (slots.get(i) in _VALUES and a is not None)) and a.dtype != dtype else a
                 for i, a in enumerate(args))


def _signature(args: tuple, ints: bool) -> tuple:
    """What the choice of road reads in a call: each tensor's shape, strides, dtype, device and
    16-byte alignment, flags, which optionals are None, and (`ints`: where a further test reads them)
    the integers; not float values (scales, probabilities), nor integers otherwise (seeds)."""
    return tuple((a.shape, a.stride(), a.dtype, a.device, a.data_ptr() & 15) if isinstance(a, torch.Tensor)
                 else a if a is None or isinstance(a, (bool, str)) or (ints and isinstance(a, int))
                 else type(a) for a in args)


_PLANS_PER_OP = 4096      # signatures remembered per op (a new sequence length is a new signature)


def _with_fallback(name: str, kernel: Kernel, reference: Callable):
    """Run the kernel when it takes these arguments (and passed its first-use check for their dtype,
    device, variant and layout), else the exact torch implementation. The choice (and the kernel's
    dtype and variant) is remembered per call signature: the checks cost the host more per call
    than some whole eager ops (benchmarks/launch_overhead.py), and their answer is a function of it."""
    plans: dict[tuple, tuple | None] = {}       # signature -> (dtype, variant), or None: the torch path

    def run(*args):
        sig = _signature(args, kernel.takes is not None)
        plan = plans.get(sig, ())
        if plan is None:
            return reference(*args)
        if plan:
            dtype, variant = plan
            kernel_args = _in_dtype(args, dtype, kernel.slots)
        else:
            ok = kernel.takes is None or kernel.takes(args)
            kernel_args = _kernel_args(args, kernel.slots, kernel.promote) if ok else None
            variant = None if kernel_args is None else self_check.variant_of(kernel_args)
            if len(plans) < _PLANS_PER_OP:
                plans[sig] = None if kernel_args is None else (kernel_args[0].dtype, variant)
            if kernel_args is None:
                return reference(*args)
        return self_check.checked(name, kernel_args, lambda: kernel.impl(*kernel_args), reference, args,
                                  variant=variant)
    return run


# The CPU and CUDA kernels go straight to the dispatcher through this library, not through the custom
# op's register_kernel, which wraps each call in a Python check that no output aliases an input:
# about 20 us of host time per call of the norm on an H200 machine (a whole eager layer_norm costs
# 17). Outputs here are fresh tensors (the launches' `_empty` buffers, or the torch
# implementation's new results); tests/unit/test_kernel_launch.py checks it for every op.
_DISPATCH = torch.library.Library(LIB, "FRAGMENT")


def register(op: FusedOp) -> None:
    """Register each custom op's kernel path: for CUDA tensors if CuPy is installed, and for CPU
    tensors, where it runs only while the CPU executor is on (else the torch implementation)."""
    try:
        import cupy  # noqa: F401
        has_cupy = True
    except ImportError:
        has_cupy = False
    for custom in op.ops:
        name = custom._name.split("::")[-1]
        # custom._init_fn: the function the op was defined with, its exact torch implementation
        run, reference = _with_fallback(name, op.kernels[name], custom._init_fn), custom._init_fn
        on_cpu = lambda *args, run=run, reference=reference: \
            run(*args) if cpu_executor.active() else reference(*args)     # noqa: E731
        _DISPATCH.impl(name, on_cpu, "CPU")
        if has_cupy:
            _DISPATCH.impl(name, run, "CUDA")
        # autograd on plain tensors straight to those (kernels/eager_autograd.py): the custom op's own
        # autograd costs the host more than the eager ops a fused op replaces
        _DISPATCH.impl(name, eager_autograd(custom, on_cpu), "AutogradCPU")
        _DISPATCH.impl(name, eager_autograd(custom, run if has_cupy else reference), "AutogradCUDA")
