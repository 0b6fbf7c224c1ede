"""Which fused-op calls run a kernel: a table from op to its launch function (kernels/launch.py)
and the arguments it takes; every other call, a kernel that failed its first-use check
(kernels/self_check.py), and any CPU tensor while the CPU executor is off run the op's exact
torch implementation. `register_impls` puts this in front of each custom op for CUDA tensors (when
CuPy imports) and for CPU tensors."""
from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from autoshard.kernels import cpu_executor, self_check
from autoshard.kernels.launch import (
    _KERNEL_DTYPES,
    bias_dropout_add,
    bias_dropout_add_backward,
    bias_gelu,
    bias_gelu_backward,
    norm,
    norm_backward,
    rotary,
    softmax,
    softmax_backward,
    swiglu,
    swiglu_backward,
)
from autoshard.kernels.reference import result_dtype

__all__ = ["register_impls"]


def _rotary_takes(args: tuple) -> bool:
    """The kernel rotates [b, heads, s, d] at the middle of d, in a dtype it has."""
    x, cos, sin, _, half = args
    return x.dim() == 4 and 2 * half == x.shape[-1] and result_dtype(x, cos, sin) in _KERNEL_DTYPES


class _Kernel(NamedTuple):
    impl: Callable
    like_first: tuple[int, ...]     # arguments read as the first tensor's kind (its shape, or a vector
                                    # over its last dim)
    promote: bool                   # inputs converted to their promoted dtype (else: one dtype or fall back)
    takes: Callable[[tuple], bool] | None = None      # a further test of the arguments


# op -> its kernel. The element-wise ops compute in the promoted dtype like the `x + bias` they
# replace, so their inputs are converted to it (for a bias, a vector, next to nothing).
_KERNELS = {
    "bias_gelu": _Kernel(bias_gelu, (1,), True),
    "bias_gelu_backward": _Kernel(bias_gelu_backward, (1, 2), True),
    "swiglu": _Kernel(swiglu, (1, 2, 3), True),
    "swiglu_backward": _Kernel(swiglu_backward, (1, 2, 3, 4), True),
    "scaled_masked_softmax": _Kernel(softmax, (), False),
    "scaled_masked_softmax_backward": _Kernel(softmax_backward, (1,), False),
    "bias_dropout_add": _Kernel(bias_dropout_add, (1, 2), True),
    "bias_dropout_add_backward": _Kernel(bias_dropout_add_backward, (), False),
    "norm": _Kernel(norm, (1, 2), False),
    "norm_backward": _Kernel(norm_backward, (1, 2), False),
    "rotary": _Kernel(rotary, (), False, _rotary_takes),
}


def _kernel_args(args: tuple, like_first: tuple[int, ...], promote: bool) -> tuple | None:
    """The arguments as the kernel reads them, or None where it cannot: every `like_first` tensor
    (if given) shaped like the first or a vector over its last dim (the kernels broadcast nothing
    else), all of one fp32 / fp16 / bf16 dtype: the first's, or with `promote` the promoted one
    they are converted to."""
    first = args[0]
    live = [i for i in like_first if args[i] is not None]
    for i in live:
        t = args[i]
        if t.shape != first.shape and not (t.dim() == 1 and t.numel() == first.shape[-1]):
            return None
    dtype = result_dtype(first, *(args[i] for i in live)) if promote else first.dtype
    if dtype not in _KERNEL_DTYPES or (not promote and any(args[i].dtype != dtype for i in live)):
        return None
    return tuple(a.to(dtype) if i == 0 or i in live else a for i, a in enumerate(args))


def _with_fallback(name: str, kernel: _Kernel, reference: Callable):
    """Run the kernel when it takes these arguments (and passed its first-use check for their dtype,
    device and variant), else the exact torch implementation."""
    def on(args: tuple):
        ok = kernel.takes is None or kernel.takes(args)
        return _kernel_args(args, kernel.like_first, kernel.promote) if ok else None

    def run(*args):
        kernel_args = on(args)
        if kernel_args is None or not self_check.trusted(name, kernel_args, lambda a: kernel.impl(*on(a)), reference):
            return reference(*args)
        return kernel.impl(*kernel_args)
    return run


def register_impls(*ops) -> None:
    """Register each custom op's kernel path: for CUDA tensors if CuPy is installed, and for CPU
    tensors, where it runs only while the CPU executor is on (else the torch implementation)."""
    try:
        import cupy  # noqa: F401
        has_cupy = True
    except ImportError:
        has_cupy = False
    for op in ops:
        name = op._name.split("::")[-1]
        # op._init_fn: the function the op was defined with, its exact torch implementation
        run, reference = _with_fallback(name, _KERNELS[name], op._init_fn), op._init_fn
        op.register_kernel("cpu")(lambda *args, run=run, reference=reference:
                                  run(*args) if cpu_executor.active() else reference(*args))
        if has_cupy:
            op.register_kernel("cuda")(run)
