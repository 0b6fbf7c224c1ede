"""SwiGLU: silu(gate + gate_bias) * (up + up_bias) in one element-wise pass
(kernels/cuda/swiglu.cu). gate and up may be the two halves of one [.., 2n] projection: the kernel
reads them as strided rows, no copy.

    y = swiglu(gate, up)                # gate, up [..., n]; biases [n] or None
"""
from __future__ import annotations

import numpy as np
import torch

from autoshard.kernels.dispatch import FULL, LIB, VECTOR, FusedOp, Kernel
from autoshard.kernels.launch import contiguous, elementwise_blocks, empty, empty_like, rows_view, run_kernel, vec
from autoshard.kernels.reference import acc_dtype, broadcast_result, result_dtype, sum_to, widened

__all__ = ["swiglu", "OP"]


# ---- the exact torch implementation: what runs without the kernel, and what it is checked against
def swiglu_fwd(a, u, ba, bu) -> torch.Tensor:
    out = result_dtype(a, u, ba, bu)
    acc = acc_dtype(out)
    z, v = a.to(acc) + widened(ba, acc), u.to(acc) + widened(bu, acc)
    return (torch.nn.functional.silu(z) * v).to(out)


def swiglu_bwd(g, a, u, ba, bu) -> tuple[torch.Tensor, torch.Tensor]:
    out = result_dtype(g, a, u, ba, bu)
    acc = acc_dtype(out)
    z, v, g = a.to(acc) + widened(ba, acc), u.to(acc) + widened(bu, acc), g.to(acc)
    s = torch.sigmoid(z)
    return (g * v * s * (1 + z * (1 - s))).to(out), (g * z * s).to(out)


# ---- the launches of kernels/cuda/swiglu.cu (kernels/launch.py: where and how they run)
def swiglu_launch(gate, up, gate_bias, up_bias):
    a, sa = rows_view(gate)
    u, su = rows_view(up)
    gb, ub = contiguous(gate_bias), contiguous(up_bias)
    rows, cols = a.shape
    y = empty(gate.shape, gate.dtype, gate.device)
    run_kernel("swiglu_fwd", gate, elementwise_blocks(rows * cols),
               (a, u, gb, ub, y, np.int64(rows), np.int64(cols), np.int64(sa),
                np.int64(su), np.int32(vec(cols, a, u, gb, ub, y, strides=(sa, su)))))
    return y


def swiglu_backward_launch(grad, gate, up, gate_bias, up_bias):
    a, sa = rows_view(gate)
    u, su = rows_view(up)
    g, gb, ub = grad.contiguous(), contiguous(gate_bias), contiguous(up_bias)
    rows, cols = a.shape
    da, du = empty_like(g), empty_like(g)
    run_kernel("swiglu_bwd", gate, elementwise_blocks(rows * cols),
               (g, a, u, gb, ub, da, du, np.int64(rows), np.int64(cols),
                np.int64(sa), np.int64(su), np.int32(vec(cols, g, a, u, gb, ub, da, du, strides=(sa, su)))))
    return da, du


# ---- the custom ops (torch.ops.autoshard.*): fake shapes for tracing, autograd, the function users call
@torch.library.custom_op(f"{LIB}::swiglu", mutates_args=())
def _swiglu(gate: torch.Tensor, up: torch.Tensor, gate_bias: torch.Tensor | None,
            up_bias: torch.Tensor | None) -> torch.Tensor:
    return swiglu_fwd(gate, up, gate_bias, up_bias).contiguous()


@torch.library.custom_op(f"{LIB}::swiglu_backward", mutates_args=())
def _swiglu_backward(grad: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, gate_bias: torch.Tensor | None,
                     up_bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    da, du = swiglu_bwd(grad, gate, up, gate_bias, up_bias)
    return da.contiguous(), du.contiguous()


@_swiglu.register_fake
def _(gate, up, gate_bias, up_bias):
    return broadcast_result(gate, up, gate_bias, up_bias)


@_swiglu_backward.register_fake
def _(grad, gate, up, gate_bias, up_bias):
    dtype = result_dtype(grad, gate, up, gate_bias, up_bias)
    return grad.new_empty(grad.shape, dtype=dtype), grad.new_empty(grad.shape, dtype=dtype)


def _swiglu_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _swiglu_grad(ctx, grad):
    gate, up, gb, ub = ctx.saved_tensors
    da, du = _swiglu_backward(grad, gate, up, gb, ub)
    return sum_to(da, gate), sum_to(du, up), sum_to(da, gb), sum_to(du, ub)


_swiglu.register_autograd(_swiglu_grad, setup_context=_swiglu_setup)


def swiglu(gate: torch.Tensor, up: torch.Tensor, gate_bias: torch.Tensor | None = None,
           up_bias: torch.Tensor | None = None) -> torch.Tensor:
    """silu(gate + gate_bias) * (up + up_bias); gate and up may be two views of one [.., 2n] tensor."""
    return _swiglu(gate, up, gate_bias, up_bias)


# which calls run the kernel (kernels/dispatch.py): argument slots, dtype promotion, a further test
OP = FusedOp("swiglu.cu", {
    "swiglu": Kernel(swiglu_launch, {1: FULL, 2: VECTOR, 3: VECTOR}, True),
    "swiglu_backward": Kernel(swiglu_backward_launch, {1: FULL, 2: FULL, 3: VECTOR, 4: VECTOR}, True),
}, (_swiglu, _swiglu_backward,))
