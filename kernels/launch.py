"""CUDA implementations of the fused ops: CuPy launches of kernels/cuda/ on torch's current stream.

Tensors cross to CuPy by DLPack (no copies); absent optional tensors are null pointers. Element-wise
kernels take 16-byte packs when the last dim and every pointer allow (`vec`), row kernels one
block per row. Only registered when CuPy imports; without it CUDA tensors run the reference.
"""
from __future__ import annotations

import numpy as np
import torch

from .build import function

__all__ = ["cuda_impl"]

_THREADS = 256


def _ptr(t: torch.Tensor | None):
    import cupy
    return np.uint64(0) if t is None else cupy.from_dlpack(t.detach())


def _aligned(*ts: torch.Tensor | None) -> bool:
    return all(t is None or t.data_ptr() % 16 == 0 for t in ts)


def _vec(cols: int, x: torch.Tensor, *ts: torch.Tensor | None) -> int:
    return int(cols % (16 // x.element_size()) == 0 and _aligned(x, *ts))


def _run(name: str, like: torch.Tensor, blocks: int, args: tuple, threads: int = _THREADS) -> None:
    import cupy
    sms = torch.cuda.get_device_properties(like.device).multi_processor_count
    grid = max(1, min(blocks, sms * 32))
    with cupy.cuda.Device(like.device.index), cupy.cuda.ExternalStream(torch.cuda.current_stream(like.device).cuda_stream):
        function(name, str(like.dtype).removeprefix("torch."))((grid,), (threads,), args)


def _elementwise_blocks(n: int) -> int:
    return (n + _THREADS - 1) // _THREADS


def _c(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.contiguous()


def bias_gelu(x, bias, approximate):
    x, bias = x.contiguous(), _c(bias)
    y, cols = torch.empty_like(x), x.shape[-1]
    _run("bias_gelu_fwd", x, _elementwise_blocks(x.numel()),
         (_ptr(x), _ptr(bias), _ptr(y), np.int64(x.numel()), np.int64(cols), np.int32(approximate == "tanh"),
          np.int32(_vec(cols, x, bias, y))))
    return y


def bias_gelu_backward(grad, x, bias, approximate):
    grad, x, bias = grad.contiguous(), x.contiguous(), _c(bias)
    dx, cols = torch.empty_like(x), x.shape[-1]
    _run("bias_gelu_bwd", x, _elementwise_blocks(x.numel()),
         (_ptr(grad), _ptr(x), _ptr(bias), _ptr(dx), np.int64(x.numel()), np.int64(cols),
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
    y = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    N = 16 // gate.element_size()
    vec = int(cols % N == 0 and sa % N == 0 and su % N == 0 and _aligned(a, u, gb, ub, y))
    _run("swiglu_fwd", gate, _elementwise_blocks(rows * cols),
         (_ptr(a), _ptr(u), _ptr(gb), _ptr(ub), _ptr(y), np.int64(rows), np.int64(cols), np.int64(sa),
          np.int64(su), np.int32(vec)))
    return y


def swiglu_backward(grad, gate, up, gate_bias, up_bias):
    a, sa = _rows_view(gate)
    u, su = _rows_view(up)
    g, gb, ub = grad.contiguous(), _c(gate_bias), _c(up_bias)
    rows, cols = a.shape
    da, du = torch.empty_like(g), torch.empty_like(g)
    N = 16 // gate.element_size()
    vec = int(cols % N == 0 and sa % N == 0 and su % N == 0 and _aligned(g, a, u, gb, ub, da, du))
    _run("swiglu_bwd", gate, _elementwise_blocks(rows * cols),
         (_ptr(g), _ptr(a), _ptr(u), _ptr(gb), _ptr(ub), _ptr(da), _ptr(du), np.int64(rows), np.int64(cols),
          np.int64(sa), np.int64(su), np.int32(vec)))
    return da, du


def softmax(x, mask, scale, causal):
    x = x.contiguous()
    b, h, sq, sk = x.shape
    m = None if mask is None else mask.to(torch.uint8).contiguous()
    y = torch.empty_like(x)
    _run("scaled_masked_softmax_fwd", x, b * h * sq,
         (_ptr(x), _ptr(m), _ptr(y), np.int64(b * h * sq), np.int64(sq), np.int64(sk), np.int64(h),
          np.float32(scale), np.int32(causal), np.int32(m is not None and m.shape[0] > 1)), threads=128)
    return y


def softmax_backward(grad, y, scale):
    grad, y = grad.contiguous(), y.contiguous()
    dx, sk = torch.empty_like(y), y.shape[-1]
    rows = y.numel() // sk
    _run("scaled_masked_softmax_bwd", y, rows,
         (_ptr(grad), _ptr(y), _ptr(dx), np.int64(rows), np.int64(sk), np.float32(scale)), threads=128)
    return dx


def bias_dropout_add(x, bias, residual, p, seed):
    x, bias, residual = x.contiguous(), _c(bias), residual.contiguous()
    y, cols = torch.empty_like(x), x.shape[-1]
    _run("bias_dropout_add_fwd", x, _elementwise_blocks(x.numel()),
         (_ptr(x), _ptr(bias), _ptr(residual), _ptr(y), np.int64(x.numel()), np.int64(cols), np.float32(p),
          np.uint32(seed & 0xFFFFFFFF), np.int32(_vec(cols, x, bias, residual, y))))
    return y


def bias_dropout_add_backward(grad, p, seed):
    grad = grad.contiguous()
    dx = torch.empty_like(grad)
    _run("bias_dropout_add_bwd", grad, _elementwise_blocks(grad.numel()),
         (_ptr(grad), _ptr(dx), np.int64(grad.numel()), np.float32(p), np.uint32(seed & 0xFFFFFFFF),
          np.int32(_vec(grad.shape[-1], grad, dx))))
    return dx


def norm(x, weight, bias, eps, rms):
    x, weight, bias = x.contiguous(), _c(weight), _c(bias)
    cols = x.shape[-1]
    rows = x.numel() // cols
    y = torch.empty_like(x)
    mean = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    rstd = torch.empty_like(mean)
    _run("norm_fwd", x, rows, (_ptr(x), _ptr(weight), _ptr(bias), _ptr(y), _ptr(mean), _ptr(rstd), np.int64(rows),
                               np.int64(cols), np.float32(eps), np.int32(rms)))
    return y, mean, rstd


def norm_backward(grad, x, weight, mean, rstd, rms):
    grad, x, weight = grad.contiguous(), x.contiguous(), _c(weight)
    cols = x.shape[-1]
    rows = x.numel() // cols
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    blocks = max(1, min(rows, 2 * sms))
    dx = torch.empty_like(x)
    dw = torch.empty(blocks, cols, dtype=torch.float32, device=x.device)
    db = torch.empty_like(dw)
    _run("norm_bwd", x, blocks, (_ptr(grad), _ptr(x), _ptr(weight), _ptr(mean.contiguous()), _ptr(rstd.contiguous()),
                                 _ptr(dx), _ptr(dw), _ptr(db), np.int64(rows), np.int64(cols), np.int32(rms)))
    return dx, dw.sum(0), db.sum(0)


def rotary(x, cos, sin, inverse):
    x = x.contiguous()
    c, s = cos.float().contiguous(), sin.float().contiguous()
    b, h, seq, d = x.shape
    y = torch.empty_like(x)
    _run("rope_apply", x, _elementwise_blocks(x.numel()),
         (_ptr(x), _ptr(c), _ptr(s), _ptr(y), np.int64(b), np.int64(h), np.int64(seq), np.int64(d),
          np.int32(c.shape[0] > 1), np.int32(inverse)))
    return y


# op -> (CUDA implementation, positions of the arguments the kernel reads as the first tensor's
# kind: same dtype, and its shape or a vector over its last dim). Anything else falls back.
_KERNELS = {
    "bias_gelu": (bias_gelu, (1,)),
    "bias_gelu_backward": (bias_gelu_backward, (1, 2)),
    "swiglu": (swiglu, (1, 2, 3)),
    "swiglu_backward": (swiglu_backward, (1, 2, 3, 4)),
    "scaled_masked_softmax": (softmax, ()),
    "scaled_masked_softmax_backward": (softmax_backward, (1,)),
    "bias_dropout_add": (bias_dropout_add, (1, 2)),
    "bias_dropout_add_backward": (bias_dropout_add_backward, ()),
    "norm": (norm, (1, 2)),
    "norm_backward": (norm_backward, (1, 2)),
    "rotary": (rotary, ()),
}
_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _kernel_takes(args: tuple, like_first: tuple[int, ...]) -> bool:
    """fp32 / fp16 / bf16, and every `like_first` argument (if given) of the first's dtype with its
    shape or as a vector over its last dim: the kernels neither convert nor broadcast otherwise."""
    first = args[0]
    if first.dtype not in _KERNEL_DTYPES:
        return False
    for i in like_first:
        t = args[i]
        if t is not None and (t.dtype != first.dtype or (t.shape != first.shape and
                                                         not (t.dim() == 1 and t.numel() == first.shape[-1]))):
            return False
    return True


def _with_fallback(impl, like_first: tuple[int, ...], reference):
    """Run the kernel when it takes these arguments, else the exact torch implementation."""
    def run(*args):
        return impl(*args) if _kernel_takes(args, like_first) else reference(*args)
    return run


def cuda_impl(*ops) -> None:
    """Register the CuPy implementation of each custom op for CUDA tensors, if CuPy is installed."""
    try:
        import cupy  # noqa: F401
    except ImportError:
        return
    for op in ops:
        impl, like_first = _KERNELS[op._name.split("::")[-1]]
        op.register_kernel("cuda")(_with_fallback(impl, like_first, op._init_fn))   # _init_fn: the reference body
