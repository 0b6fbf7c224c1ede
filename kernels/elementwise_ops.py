"""Element-wise fused ops as custom ops: bias + GeLU, SwiGLU, bias + dropout + residual. Each
returns the dtype torch's type promotion gives the expression it replaces (`x + bias` with a bf16
x and an fp32 bias is fp32), so a fused graph keeps the unfused one's dtypes. Outputs (backward's
too) are contiguous whatever the inputs' strides, as the CUDA kernels write them and the fake
implementations declare them: torch.compile plans with the fakes' strides, so they must be true."""
from __future__ import annotations

import torch

from autoshard.kernels import reference as ref
from autoshard.kernels.dispatch import register_impls
from autoshard.kernels.op_common import LIB as _LIB
from autoshard.kernels.op_common import broadcast as _broadcast
from autoshard.kernels.op_common import sum_to as _sum_to

__all__ = ["bias_gelu", "swiglu", "bias_dropout_add", "draw_seed"]


# ---- bias + GeLU ---------------------------------------------------------------------------------
@torch.library.custom_op(f"{_LIB}::bias_gelu", mutates_args=())
def _bias_gelu(x: torch.Tensor, bias: torch.Tensor | None, approximate: str) -> torch.Tensor:
    return ref.bias_gelu_fwd(x, bias, approximate == "tanh").contiguous()


@torch.library.custom_op(f"{_LIB}::bias_gelu_backward", mutates_args=())
def _bias_gelu_backward(grad: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None,
                        approximate: str) -> torch.Tensor:
    return ref.bias_gelu_bwd(grad, x, bias, approximate == "tanh").contiguous()


@_bias_gelu.register_fake
def _(x, bias, approximate):
    return _broadcast(x, bias)


@_bias_gelu_backward.register_fake
def _(grad, x, bias, approximate):
    return grad.new_empty(grad.shape, dtype=ref.result_dtype(grad, x, bias))


def _bias_gelu_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0], inputs[1])
    ctx.approximate = inputs[2]


def _bias_gelu_grad(ctx, grad):
    x, bias = ctx.saved_tensors
    dx = _bias_gelu_backward(grad, x, bias, ctx.approximate)
    return _sum_to(dx, x), _sum_to(dx, bias), None


_bias_gelu.register_autograd(_bias_gelu_grad, setup_context=_bias_gelu_setup)


def bias_gelu(x: torch.Tensor, bias: torch.Tensor | None = None, approximate: str = "tanh") -> torch.Tensor:
    """gelu(x + bias); `approximate` "tanh" or "none" (erf), as torch.nn.functional.gelu."""
    if approximate not in ("tanh", "none"):
        raise ValueError(f"approximate must be 'tanh' or 'none', got {approximate!r}")
    return _bias_gelu(x, bias, approximate)


# ---- SwiGLU --------------------------------------------------------------------------------------
@torch.library.custom_op(f"{_LIB}::swiglu", mutates_args=())
def _swiglu(gate: torch.Tensor, up: torch.Tensor, gate_bias: torch.Tensor | None,
            up_bias: torch.Tensor | None) -> torch.Tensor:
    return ref.swiglu_fwd(gate, up, gate_bias, up_bias).contiguous()


@torch.library.custom_op(f"{_LIB}::swiglu_backward", mutates_args=())
def _swiglu_backward(grad: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, gate_bias: torch.Tensor | None,
                     up_bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    da, du = ref.swiglu_bwd(grad, gate, up, gate_bias, up_bias)
    return da.contiguous(), du.contiguous()


@_swiglu.register_fake
def _(gate, up, gate_bias, up_bias):
    return _broadcast(gate, up, gate_bias, up_bias)


@_swiglu_backward.register_fake
def _(grad, gate, up, gate_bias, up_bias):
    dtype = ref.result_dtype(grad, gate, up, gate_bias, up_bias)
    return grad.new_empty(grad.shape, dtype=dtype), grad.new_empty(grad.shape, dtype=dtype)


def _swiglu_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _swiglu_grad(ctx, grad):
    gate, up, gb, ub = ctx.saved_tensors
    da, du = _swiglu_backward(grad, gate, up, gb, ub)
    return _sum_to(da, gate), _sum_to(du, up), _sum_to(da, gb), _sum_to(du, ub)


_swiglu.register_autograd(_swiglu_grad, setup_context=_swiglu_setup)


def swiglu(gate: torch.Tensor, up: torch.Tensor, gate_bias: torch.Tensor | None = None,
           up_bias: torch.Tensor | None = None) -> torch.Tensor:
    """silu(gate + gate_bias) * (up + up_bias); gate and up may be two views of one [.., 2n] tensor."""
    return _swiglu(gate, up, gate_bias, up_bias)


# ---- bias + dropout + residual -------------------------------------------------------------------
@torch.library.custom_op(f"{_LIB}::bias_dropout_add", mutates_args=())
def _bias_dropout_add(x: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor, p: float,
                      seed: int) -> torch.Tensor:
    return ref.bias_dropout_add_fwd(x, bias, residual, p, seed).contiguous()


@torch.library.custom_op(f"{_LIB}::bias_dropout_add_backward", mutates_args=())
def _bias_dropout_add_backward(grad: torch.Tensor, p: float, seed: int) -> torch.Tensor:
    return ref.bias_dropout_add_bwd(grad, p, seed).contiguous()


@_bias_dropout_add.register_fake
def _(x, bias, residual, p, seed):
    return _broadcast(x, bias, residual)


@_bias_dropout_add_backward.register_fake
def _(grad, p, seed):
    return grad.new_empty(grad.shape)


def _bda_setup(ctx, inputs, output):
    ctx.likes = tuple(None if t is None else (t.shape, t.dtype) for t in inputs[:3])
    ctx.p, ctx.seed = inputs[3], inputs[4]


def _bda_grad(ctx, grad):
    x, bias, residual = ctx.likes
    dx = _bias_dropout_add_backward(grad, ctx.p, ctx.seed)
    return _sum_to(dx, x), _sum_to(dx, bias), _sum_to(grad, residual), None, None


_bias_dropout_add.register_autograd(_bda_grad, setup_context=_bda_setup)


def draw_seed(device: torch.device | str = "cpu") -> int:
    """A 31-bit seed from torch's generator for `device` (so torch.manual_seed and autoshard's
    per-region RNG states govern the fused dropout too)."""
    return int(torch.randint(0, 2**31 - 1, (1,), device=device).item())


def bias_dropout_add(x: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor, p: float, *,
                     training: bool = True, seed: int | None = None) -> torch.Tensor:
    """residual + dropout(x + bias, p); the mask is a hash of (seed, element index), regenerated in
    backward instead of stored."""
    if not 0 <= p <= 1:
        raise ValueError(f"dropout probability must be in [0, 1], got {p}")
    p = float(p) if training else 0.0
    return _bias_dropout_add(x, bias, residual, p, draw_seed(x.device) if seed is None and p > 0 else (seed or 0))


register_impls(_bias_gelu, _bias_gelu_backward, _swiglu, _swiglu_backward, _bias_dropout_add, _bias_dropout_add_backward)
