"""Bias + GeLU: gelu(x + bias), the tanh form or the exact (erf) one, as one element-wise pass
(kernels/cuda/bias_gelu.cu). The backward recomputes x + bias and returns the gradient of the sum;
the custom op's autograd sums it down to the bias's shape.

    y = bias_gelu(x, bias)              # x [..., cols], bias [cols] or None; tanh form
"""
from __future__ import annotations

import math

import numpy as np
import torch

from autoshard.kernels.dispatch import FULL, LIB, VECTOR, FusedOp, Kernel
from autoshard.kernels.launch import contiguous, elementwise_blocks, empty_like, run_kernel, vec
from autoshard.kernels.reference import acc_dtype, broadcast_result, result_dtype, sum_to, widened

__all__ = ["bias_gelu", "OP"]


# ---- the exact torch implementation: what runs without the kernel, and what it is checked against
def gelu(u: torch.Tensor, tanh_form: bool) -> torch.Tensor:
    if tanh_form:
        return 0.5 * u * (1 + torch.tanh(math.sqrt(2 / math.pi) * (u + 0.044715 * u**3)))
    return 0.5 * u * (1 + torch.erf(u / math.sqrt(2)))


def gelu_slope(u: torch.Tensor, tanh_form: bool) -> torch.Tensor:
    if tanh_form:
        k = math.sqrt(2 / math.pi)
        t = torch.tanh(k * (u + 0.044715 * u**3))
        return 0.5 * (1 + t) + 0.5 * u * (1 - t * t) * k * (1 + 3 * 0.044715 * u * u)
    return 0.5 * (1 + torch.erf(u / math.sqrt(2))) + u * torch.exp(-0.5 * u * u) / math.sqrt(2 * math.pi)


def bias_gelu_fwd(x, b, tanh_form: bool) -> torch.Tensor:
    out = result_dtype(x, b)
    acc = acc_dtype(out)
    return gelu(x.to(acc) + widened(b, acc), tanh_form).to(out)


def bias_gelu_bwd(g, x, b, tanh_form: bool) -> torch.Tensor:
    out = result_dtype(g, x, b)
    acc = acc_dtype(out)
    return (g.to(acc) * gelu_slope(x.to(acc) + widened(b, acc), tanh_form)).to(out)


# ---- the launches of kernels/cuda/bias_gelu.cu (kernels/launch.py: where and how they run)
def bias_gelu_launch(x, bias, approximate):
    x, bias = x.contiguous(), contiguous(bias)
    y, cols = empty_like(x), x.shape[-1]
    run_kernel("bias_gelu_fwd", x, elementwise_blocks(x.numel()),
               (x, bias, y, np.int64(x.numel()), np.int64(cols), np.int32(approximate == "tanh"),
                np.int32(vec(cols, x, bias, y))))
    return y


def bias_gelu_backward_launch(grad, x, bias, approximate):
    grad, x, bias = grad.contiguous(), x.contiguous(), contiguous(bias)
    dx, cols = empty_like(x), x.shape[-1]
    run_kernel("bias_gelu_bwd", x, elementwise_blocks(x.numel()),
               (grad, x, bias, dx, np.int64(x.numel()), np.int64(cols),
                np.int32(approximate == "tanh"), np.int32(vec(cols, x, grad, bias, dx))))
    return dx


# ---- the custom ops (torch.ops.autoshard.*): fake shapes for tracing, autograd, the function users call
@torch.library.custom_op(f"{LIB}::bias_gelu", mutates_args=())
def _bias_gelu(x: torch.Tensor, bias: torch.Tensor | None, approximate: str) -> torch.Tensor:
    return bias_gelu_fwd(x, bias, approximate == "tanh").contiguous()


@torch.library.custom_op(f"{LIB}::bias_gelu_backward", mutates_args=())
def _bias_gelu_backward(grad: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None,
                        approximate: str) -> torch.Tensor:
    return bias_gelu_bwd(grad, x, bias, approximate == "tanh").contiguous()


@_bias_gelu.register_fake
def _(x, bias, approximate):
    return broadcast_result(x, bias)


@_bias_gelu_backward.register_fake
def _(grad, x, bias, approximate):
    return grad.new_empty(grad.shape, dtype=result_dtype(grad, x, bias))


def _bias_gelu_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0], inputs[1])
    ctx.approximate = inputs[2]


def _bias_gelu_grad(ctx, grad):
    x, bias = ctx.saved_tensors
    dx = _bias_gelu_backward(grad, x, bias, ctx.approximate)
    return sum_to(dx, x), sum_to(dx, bias), None


_bias_gelu.register_autograd(_bias_gelu_grad, setup_context=_bias_gelu_setup)


def bias_gelu(x: torch.Tensor, bias: torch.Tensor | None = None, approximate: str = "tanh") -> torch.Tensor:
    """gelu(x + bias); `approximate` "tanh" or "none" (erf), as torch.nn.functional.gelu."""
    if approximate not in ("tanh", "none"):
        raise ValueError(f"approximate must be 'tanh' or 'none', got {approximate!r}")
    return _bias_gelu(x, bias, approximate)


# which calls run the kernel (kernels/dispatch.py): argument slots, dtype promotion, a further test
OP = FusedOp("bias_gelu.cu", {
    "bias_gelu": Kernel(bias_gelu_launch, {1: VECTOR}, True),
    "bias_gelu_backward": Kernel(bias_gelu_backward_launch, {1: FULL, 2: VECTOR}, True),
}, (_bias_gelu, _bias_gelu_backward,))
