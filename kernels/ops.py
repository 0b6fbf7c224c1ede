"""The fused ops as torch custom ops (namespace `autoshard`), so graphs, autograd and torch.compile
see ordinary ops. Each has an exact torch implementation (kernels/reference.py) that runs on every
device, a CUDA implementation launching the CuPy kernel of kernels/cuda/ on torch's current stream
(tensors cross as device pointers, no copies), a fake implementation for tracing, and autograd whose
backward is again a custom op.

    from autoshard.kernels import ops
    y = ops.bias_gelu(x, b)                        # gelu(x + b), tanh form
    y = torch.ops.autoshard.bias_gelu(x, b, "none")   # the erf form, as the registered op

Element-wise ops (bias + GeLU, SwiGLU, bias + dropout + residual) return the dtype torch's type
promotion gives the expression they replace (`x + bias` with a bf16 x and an fp32 bias is fp32), so
a fused graph keeps the unfused one's dtypes. Row-wise ops (scaled masked softmax, LayerNorm /
RMSNorm, rotary embedding): the norm returns its input's dtype, softmax too; rotary promotes like
the `x * cos` it replaces. Every output (backward's too) is contiguous whatever the inputs' strides,
as the CUDA kernels write them and the fake implementations declare them: torch.compile plans with
the fakes' strides, so they must be true. The ops broadcast inputs as the unfused torch code does.
"""
from __future__ import annotations

import torch

from autoshard.kernels import reference as ref
from autoshard.kernels.dispatch import LIB as _LIB
from autoshard.kernels.dispatch import register_impls

__all__ = ["bias_gelu", "swiglu", "scaled_masked_softmax", "bias_dropout_add", "layer_norm", "rms_norm",
           "rotary", "draw_seed"]


# ---- shared: shapes and dtypes of broadcast inputs ---------------------------------------------
def _sum_to(t: torch.Tensor, like: torch.Tensor | tuple | None) -> torch.Tensor | None:
    """The gradient of a broadcast input: `t` summed down to `like`'s shape. The ops broadcast as
    the unfused torch code does (the fusion pass relies on it); the CUDA kernels take the plain
    case and leave the rest to the torch implementation."""
    if like is None:
        return None
    shape, dtype = like if isinstance(like, tuple) else (like.shape, like.dtype)
    return t.sum_to_size(shape).to(dtype)


def _broadcast(*ts: torch.Tensor | None) -> torch.Tensor:
    """The result of an element-wise op over `ts`: broadcast shape, promoted dtype (fake kernels)."""
    live = [t for t in ts if t is not None]
    shape = torch.broadcast_shapes(*(t.shape for t in live))
    return live[0].new_empty(shape, dtype=ref.result_dtype(*live))


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


# ---- scaled masked softmax -----------------------------------------------------------------------
@torch.library.custom_op(f"{_LIB}::scaled_masked_softmax", mutates_args=())
def _softmax(x: torch.Tensor, mask: torch.Tensor | None, scale: float, causal: bool) -> torch.Tensor:
    return ref.softmax_fwd(x, mask, scale, causal).contiguous()


@torch.library.custom_op(f"{_LIB}::scaled_masked_softmax_backward", mutates_args=())
def _softmax_backward(grad: torch.Tensor, y: torch.Tensor, scale: float) -> torch.Tensor:
    return ref.softmax_bwd(grad, y, scale).contiguous()


@_softmax.register_fake
def _(x, mask, scale, causal):
    return x.new_empty(x.shape)                      # contiguous, as the implementations return it


@_softmax_backward.register_fake
def _(grad, y, scale):
    return y.new_empty(y.shape)


def _softmax_setup(ctx, inputs, output):
    ctx.save_for_backward(output)
    ctx.scale = inputs[2]


def _softmax_grad(ctx, grad):
    (y,) = ctx.saved_tensors
    return _softmax_backward(grad, y, ctx.scale), None, None, None


_softmax.register_autograd(_softmax_grad, setup_context=_softmax_setup)


def scaled_masked_softmax(x: torch.Tensor, mask: torch.Tensor | None = None, scale: float = 1.0,
                          causal: bool = False) -> torch.Tensor:
    """softmax(scale * x) over the last dim of [b, heads, sq, sk] scores, keys masked where `mask`
    [1 or b, sq, sk] is nonzero and, with `causal`, above the diagonal; fully masked rows are 0."""
    if x.dim() != 4:
        raise ValueError(f"scaled_masked_softmax takes [batch, heads, sq, sk] scores, got {tuple(x.shape)}")
    if mask is not None and (mask.dim() != 3 or mask.shape[1:] != x.shape[2:] or mask.shape[0] not in (1, x.shape[0])):
        raise ValueError(f"mask {tuple(mask.shape)} is not [1 or {x.shape[0]}, {x.shape[2]}, {x.shape[3]}]")
    return _softmax(x, mask, float(scale), bool(causal))


# ---- LayerNorm / RMSNorm -------------------------------------------------------------------------
@torch.library.custom_op(f"{_LIB}::norm", mutates_args=())
def _norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float,
          rms: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return tuple(t.contiguous() for t in ref.norm_fwd(x, weight, bias, eps, rms))


@torch.library.custom_op(f"{_LIB}::norm_backward", mutates_args=())
def _norm_backward(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, mean: torch.Tensor,
                   rstd: torch.Tensor, rms: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return tuple(t.contiguous() for t in ref.norm_bwd(grad, x, weight, mean, rstd, rms))


@_norm.register_fake
def _(x, weight, bias, eps, rms):
    stat = torch.float64 if x.dtype == torch.float64 else torch.float32
    return x.new_empty(x.shape), x.new_empty(x.shape[:-1], dtype=stat), x.new_empty(x.shape[:-1], dtype=stat)


@_norm_backward.register_fake
def _(grad, x, weight, mean, rstd, rms):
    acc = ref._acc(x)
    return x.new_empty(x.shape), x.new_empty(x.shape[-1:], dtype=acc), x.new_empty(x.shape[-1:], dtype=acc)


def _norm_setup(ctx, inputs, output):
    x, weight, bias, _, rms = inputs
    ctx.save_for_backward(x, weight, output[1], output[2])
    ctx.rms, ctx.bias_like = rms, bias


def _norm_grad(ctx, grad, _gmean, _grstd):
    x, weight, mean, rstd = ctx.saved_tensors
    dx, dw, db = _norm_backward(grad, x, weight, mean, rstd, ctx.rms)
    bias = ctx.bias_like
    return (dx, None if weight is None else dw.to(weight.dtype), None if bias is None else db.to(bias.dtype),
            None, None)


_norm.register_autograd(_norm_grad, setup_context=_norm_setup)
# No autocast rule (CUDA autocast runs layer_norm in fp32): registering one with
# torch.library.register_autocast made a later call of another autoshard op segfault inside torch's
# dispatch (torch 2.13; 8 runs in 8 of tests/simulation/test_fuse.py then the rotary test). passes/fusion/fuse.py
# says what that leaves different.


def layer_norm(x: torch.Tensor, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None,
               eps: float = 1e-5) -> torch.Tensor:
    """LayerNorm over the last dim (torch.nn.functional.layer_norm with normalized_shape = x.shape[-1:])."""
    return _norm(x, weight, bias, float(eps), False)[0]


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight over the last dim (Llama's RMSNorm)."""
    return _norm(x, weight, None, float(eps), True)[0]


# ---- rotary position embedding -------------------------------------------------------------------
@torch.library.custom_op(f"{_LIB}::rotary", mutates_args=())
def _rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool, half: int) -> torch.Tensor:
    return ref.rope_apply(x, cos, sin, inverse, half).contiguous()


@_rotary.register_fake
def _(x, cos, sin, inverse, half):
    return x.new_empty(x.shape, dtype=ref.result_dtype(x, cos, sin))


def _rotary_setup(ctx, inputs, output):
    x, cos, sin, inverse, half = inputs
    ctx.save_for_backward(cos, sin)
    ctx.inverse, ctx.half, ctx.x_dtype = inverse, half, x.dtype


def _rotary_grad(ctx, grad):
    cos, sin = ctx.saved_tensors
    return _rotary(grad, cos, sin, not ctx.inverse, ctx.half).to(ctx.x_dtype), None, None, None, None


_rotary.register_autograd(_rotary_grad, setup_context=_rotary_setup)


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding (rotate-half form) applied to q and k [b, heads, s, d] with cos, sin
    [1 or b, s, d] (no gradient flows into the tables)."""
    for name, t in (("q", q), ("k", k)):
        if t.dim() != 4 or t.shape[-1] % 2 or cos.shape[-2:] != t.shape[-2:]:
            raise ValueError(f"rotary: {name} {tuple(t.shape)} must be [b, heads, s, d] (d even) matching "
                             f"cos {tuple(cos.shape)} [1 or b, s, d]")
    cos, sin = cos.detach(), sin.detach()
    return _rotary(q, cos, sin, False, q.shape[-1] // 2), _rotary(k, cos, sin, False, k.shape[-1] // 2)


register_impls(_softmax, _softmax_backward, _norm, _norm_backward, _rotary)
