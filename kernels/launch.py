"""CUDA implementations of the fused ops: launches of kernels/cuda/ through CuPy on torch's current
stream, or, for CPU tensors while the CPU executor is on (kernels/cpu_executor/), the same
kernels run on the CPU through the same code here (pack choice, strides, grid sizing).

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
from autoshard.kernels.reference import result_dtype

__all__ = ["poisoned_outputs", "LAUNCHES", "kernel_arg", "bias_gelu", "bias_gelu_backward", "swiglu",
           "swiglu_backward", "softmax", "softmax_backward", "bias_dropout_add", "bias_dropout_add_backward",
           "norm", "norm_backward", "rotary"]

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


def _vec(cols: int, x: torch.Tensor, *ts: torch.Tensor | None, strides: tuple[int, ...] = ()) -> int:
    """1 when rows of `cols` elements (and every row stride) are whole 16-byte packs of x's dtype and
    every pointer is 16-byte aligned."""
    n = 16 // x.element_size()
    return int(all(v % n == 0 for v in (cols, *strides)) and _aligned(x, *ts))


@functools.cache
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _sm_count(like: torch.Tensor) -> int:
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


def _run(name: str, like: torch.Tensor, blocks: int, args: tuple, threads: int = _THREADS) -> None:
    """Launch `name<like's dtype>` with at most 32 blocks per SM (the kernels stride over the rest):
    on torch's current stream, or for a CPU tensor on the CPU executor."""
    grid = max(1, min(blocks, _sm_count(like) * 32))
    dtype_name = str(like.dtype).removeprefix("torch.")
    if like.is_cuda:
        _launch_cuda(name, dtype_name, like.device, grid, threads, args)
    else:
        cpu_executor.launch(name, dtype_name, grid, threads, args)
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
    m = None if mask is None else (mask != 0).to(torch.uint8).contiguous()     # nonzero = masked, any dtype
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
    blocks = max(1, min(rows, 2 * _sm_count(x)))
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
