"""CUDA implementations of the fused ops: CuPy launches of kernels/cuda/ on torch's current stream.

Tensors cross to CuPy by DLPack (no copies), converted while CuPy's current stream is torch's, so
the exchange adds no cross-stream wait (and works under CUDA graph capture); absent optional tensors
are null pointers. Element-wise kernels take 16-byte packs when the last dim and every pointer allow
(`vec`), row kernels one block per row. Only registered when CuPy imports; without it CUDA tensors
run the reference. `poisoned_outputs()` fills every buffer a kernel writes with NaN first, so a
test sees any element a kernel leaves unwritten.
"""
from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Iterator
from typing import NamedTuple

import numpy as np
import torch

from autoshard.kernels.build import function
from autoshard.kernels.reference import result_dtype

__all__ = ["cuda_impl", "poisoned_outputs", "LAUNCHES"]

_THREADS = 256
_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
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


def _empty(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    t = torch.empty(shape, dtype=dtype, device=device)
    return t.fill_(float("nan")) if _POISON else t


def _empty_like(t: torch.Tensor) -> torch.Tensor:
    return _empty(t.shape, t.dtype, t.device)


def _arg(a):
    """A kernel argument for CuPy: tensors by DLPack, None as a null pointer, scalars as they are."""
    import cupy
    if isinstance(a, torch.Tensor):
        return cupy.from_dlpack(a.detach())
    return np.uint64(0) if a is None else a


def _aligned(*ts: torch.Tensor | None) -> bool:
    return all(t is None or t.data_ptr() % 16 == 0 for t in ts)


def _vec(cols: int, x: torch.Tensor, *ts: torch.Tensor | None, strides: tuple[int, ...] = ()) -> int:
    """1 when rows of `cols` elements (and every row stride) are whole 16-byte packs of x's dtype and
    every pointer is 16-byte aligned."""
    n = 16 // x.element_size()
    return int(all(v % n == 0 for v in (cols, *strides)) and _aligned(x, *ts))


def _run(name: str, like: torch.Tensor, blocks: int, args: tuple, threads: int = _THREADS) -> None:
    """Launch `name<like's dtype>` on torch's current stream with at most 32 blocks per SM (the
    kernels stride over the rest)."""
    import cupy
    sms = torch.cuda.get_device_properties(like.device).multi_processor_count
    grid = max(1, min(blocks, sms * 32))
    kernel = function(name, str(like.dtype).removeprefix("torch."))
    stream = torch.cuda.current_stream(like.device).cuda_stream
    with cupy.cuda.Device(like.device.index), cupy.cuda.ExternalStream(stream):
        kernel((grid,), (threads,), tuple(_arg(a) for a in args))
    LAUNCHES[name] += 1


def _elementwise_blocks(n: int) -> int:
    return (n + _THREADS - 1) // _THREADS


def _c(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.contiguous()


def bias_gelu(x, bias, approximate):
    x, bias = x.contiguous(), _c(bias)
    y, cols = _empty_like(x), x.shape[-1]
    _run("bias_gelu_fwd", x, _elementwise_blocks(x.numel()),
         (x, bias, y, np.int64(x.numel()), np.int64(cols), np.int32(approximate == "tanh"),
          np.int32(_vec(cols, x, bias, y))))
    return y


def bias_gelu_backward(grad, x, bias, approximate):
    grad, x, bias = grad.contiguous(), x.contiguous(), _c(bias)
    dx, cols = _empty_like(x), x.shape[-1]
    _run("bias_gelu_bwd", x, _elementwise_blocks(x.numel()),
         (grad, x, bias, dx, np.int64(x.numel()), np.int64(cols),
          np.int32(approximate == "tanh"), np.int32(_vec(cols, x, grad, bias, dx))))
    return dx


def _rows_view(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """t as [rows, cols] and its row stride; a view when possible (two halves of a [.., 2n] tensor
    stay views with stride 2n)."""
    v = t.reshape(-1, t.shape[-1])
    if v.stride(-1) != 1:
        v = v.contiguous()
    return v, v.stride(0)


def swiglu(gate, up, gate_bias, up_bias):
    a, sa = _rows_view(gate)
    u, su = _rows_view(up)
    gb, ub = _c(gate_bias), _c(up_bias)
    rows, cols = a.shape
    y = _empty(gate.shape, gate.dtype, gate.device)
    _run("swiglu_fwd", gate, _elementwise_blocks(rows * cols),
         (a, u, gb, ub, y, np.int64(rows), np.int64(cols), np.int64(sa),
          np.int64(su), np.int32(_vec(cols, a, u, gb, ub, y, strides=(sa, su)))))
    return y


def swiglu_backward(grad, gate, up, gate_bias, up_bias):
    a, sa = _rows_view(gate)
    u, su = _rows_view(up)
    g, gb, ub = grad.contiguous(), _c(gate_bias), _c(up_bias)
    rows, cols = a.shape
    da, du = _empty_like(g), _empty_like(g)
    _run("swiglu_bwd", gate, _elementwise_blocks(rows * cols),
         (g, a, u, gb, ub, da, du, np.int64(rows), np.int64(cols),
          np.int64(sa), np.int64(su), np.int32(_vec(cols, g, a, u, gb, ub, da, du, strides=(sa, su)))))
    return da, du


def softmax(x, mask, scale, causal):
    x = x.contiguous()
    b, h, sq, sk = x.shape
    m = None if mask is None else mask.to(torch.uint8).contiguous()
    y = _empty_like(x)
    _run("scaled_masked_softmax_fwd", x, b * h * sq,
         (x, m, y, np.int64(b * h * sq), np.int64(sq), np.int64(sk), np.int64(h),
          np.float32(scale), np.int32(causal), np.int32(m is not None and m.shape[0] > 1)), threads=128)
    return y


def softmax_backward(grad, y, scale):
    grad, y = grad.contiguous(), y.contiguous()
    dx, sk = _empty_like(y), y.shape[-1]
    rows = y.numel() // sk
    _run("scaled_masked_softmax_bwd", y, rows,
         (grad, y, dx, np.int64(rows), np.int64(sk), np.float32(scale)), threads=128)
    return dx


def bias_dropout_add(x, bias, residual, p, seed):
    x, bias, residual = x.contiguous(), _c(bias), residual.contiguous()
    y, cols = _empty_like(x), x.shape[-1]
    _run("bias_dropout_add_fwd", x, _elementwise_blocks(x.numel()),
         (x, bias, residual, y, np.int64(x.numel()), np.int64(cols), np.float32(p),
          np.uint32(seed & 0xFFFFFFFF), np.int32(_vec(cols, x, bias, residual, y))))
    return y


def bias_dropout_add_backward(grad, p, seed):
    grad = grad.contiguous()
    dx = _empty_like(grad)
    _run("bias_dropout_add_bwd", grad, _elementwise_blocks(grad.numel()),
         (grad, dx, np.int64(grad.numel()), np.float32(p), np.uint32(seed & 0xFFFFFFFF),
          np.int32(_vec(grad.shape[-1], grad, dx))))
    return dx


def norm(x, weight, bias, eps, rms):
    x, weight, bias = x.contiguous(), _c(weight), _c(bias)
    cols = x.shape[-1]
    rows = x.numel() // cols
    y = _empty_like(x)
    mean = _empty(x.shape[:-1], torch.float32, x.device)
    rstd = _empty_like(mean)
    _run("norm_fwd", x, rows, (x, weight, bias, y, mean, rstd, np.int64(rows),
                               np.int64(cols), np.float32(eps), np.int32(rms)))
    return y, mean, rstd


def norm_backward(grad, x, weight, mean, rstd, rms):
    grad, x, weight = grad.contiguous(), x.contiguous(), _c(weight)
    cols = x.shape[-1]
    rows = x.numel() // cols
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    blocks = max(1, min(rows, 2 * sms))
    dx = _empty_like(x)
    dw = _empty((blocks, cols), torch.float32, x.device)
    db = _empty_like(dw)
    _run("norm_bwd", x, blocks, (grad, x, weight, mean.contiguous(), rstd.contiguous(),
                                 dx, dw, db, np.int64(rows), np.int64(cols), np.int32(rms)))
    return dx, dw.sum(0), db.sum(0)


def rotary(x, cos, sin, inverse, half):
    x = x.to(result_dtype(x, cos, sin)).contiguous()        # x * cos promotes (an fp32 table under autocast)
    c, s = cos.float().contiguous(), sin.float().contiguous()
    b, h, seq, d = x.shape
    y = _empty_like(x)
    _run("rope_apply", x, _elementwise_blocks(x.numel()),
         (x, c, s, y, np.int64(b), np.int64(h), np.int64(seq), np.int64(d),
          np.int32(c.shape[0] > 1), np.int32(inverse)))
    return y


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


def _with_fallback(kernel: _Kernel, reference: Callable):
    """Run the kernel when it takes these arguments, else the exact torch implementation."""
    def run(*args):
        ok = kernel.takes is None or kernel.takes(args)
        kernel_args = _kernel_args(args, kernel.like_first, kernel.promote) if ok else None
        return reference(*args) if kernel_args is None else kernel.impl(*kernel_args)
    return run


def cuda_impl(*ops) -> None:
    """Register the CuPy implementation of each custom op for CUDA tensors, if CuPy is installed."""
    try:
        import cupy  # noqa: F401
    except ImportError:
        return
    for op in ops:
        # op._init_fn: the function the op was defined with, its exact torch implementation
        op.register_kernel("cuda")(_with_fallback(_KERNELS[op._name.split("::")[-1]], op._init_fn))
