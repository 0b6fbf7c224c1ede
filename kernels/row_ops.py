"""Row-wise fused ops as custom ops: scaled masked softmax, LayerNorm / RMSNorm, rotary embedding.
The norm returns its input's dtype, softmax too; rotary promotes like the `x * cos` it replaces.
Like the element-wise ops, every output (backward's too) is contiguous whatever the inputs'
strides, on every device and in the fake implementations alike."""
from __future__ import annotations

import torch

from autoshard.kernels import reference as ref
from autoshard.kernels.dispatch import register_impls
from autoshard.kernels.op_common import LIB as _LIB

__all__ = ["scaled_masked_softmax", "layer_norm", "rms_norm", "rotary"]


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
