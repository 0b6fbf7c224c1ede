"""The fused ops' exact torch implementations: what runs on the CPU, and what the CUDA kernels are
checked against. Arithmetic in fp32 (fp64 for fp64 inputs). The element-wise ops return the dtype
torch's type promotion gives the expression they replace (`x + bias` with a bf16 x and an fp32 bias
is fp32); norm, softmax and rotary return their input's dtype.

Shapes: x [..., cols]; biases [cols]; attention scores [batch, heads, sq, sk] with a uint8/bool
mask [1 or batch, sq, sk] (nonzero = masked); rotary tables [1 or batch, seq, dim].
"""
from __future__ import annotations

import functools
import math

import torch

__all__ = ["result_dtype", "gelu", "gelu_slope", "bias_gelu_fwd", "bias_gelu_bwd", "swiglu_fwd", "swiglu_bwd",
           "softmax_fwd", "softmax_bwd", "keep_mask", "bias_dropout_add_fwd", "bias_dropout_add_bwd", "norm_fwd",
           "norm_bwd", "rope_apply"]

_M32 = 0xFFFFFFFF


def _acc(x: torch.Tensor | torch.dtype) -> torch.dtype:
    return torch.promote_types(x if isinstance(x, torch.dtype) else x.dtype, torch.float32)


def result_dtype(*ts: torch.Tensor | None) -> torch.dtype:
    """The dtype of an element-wise expression over `ts` under torch's type promotion."""
    return functools.reduce(torch.promote_types, (t.dtype for t in ts if t is not None))


def _up(x: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | float:
    return 0.0 if x is None else x.to(dtype)


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
    acc = _acc(out)
    return gelu(x.to(acc) + _up(b, acc), tanh_form).to(out)


def bias_gelu_bwd(g, x, b, tanh_form: bool) -> torch.Tensor:
    out = result_dtype(g, x, b)
    acc = _acc(out)
    return (g.to(acc) * gelu_slope(x.to(acc) + _up(b, acc), tanh_form)).to(out)


def swiglu_fwd(a, u, ba, bu) -> torch.Tensor:
    out = result_dtype(a, u, ba, bu)
    acc = _acc(out)
    z, v = a.to(acc) + _up(ba, acc), u.to(acc) + _up(bu, acc)
    return (torch.nn.functional.silu(z) * v).to(out)


def swiglu_bwd(g, a, u, ba, bu) -> tuple[torch.Tensor, torch.Tensor]:
    out = result_dtype(g, a, u, ba, bu)
    acc = _acc(out)
    z, v, g = a.to(acc) + _up(ba, acc), u.to(acc) + _up(bu, acc), g.to(acc)
    s = torch.sigmoid(z)
    return (g * v * s * (1 + z * (1 - s))).to(out), (g * z * s).to(out)


def _masked(x: torch.Tensor, mask: torch.Tensor | None, causal: bool) -> torch.Tensor:
    sq, sk = x.shape[-2], x.shape[-1]
    off = torch.zeros(sq, sk, dtype=torch.bool, device=x.device)
    if causal:
        off = torch.ones(sq, sk, dtype=torch.bool, device=x.device).triu(sk - sq + 1)
    if mask is not None:
        off = off | mask.bool().unsqueeze(1)            # (1 or b, 1, sq, sk): shared by the heads
    return off


def softmax_fwd(x, mask, scale: float, causal: bool) -> torch.Tensor:
    acc = _acc(x)
    off = _masked(x, mask, causal)
    z = (x.to(acc) * scale).masked_fill(off, -math.inf)
    top = z.amax(-1, keepdim=True)
    e = torch.where(off, 0.0, torch.exp(z - top.masked_fill(top == -math.inf, 0.0)))
    total = e.sum(-1, keepdim=True)
    return torch.where(total > 0, e / total.clamp_min(torch.finfo(acc).tiny), 0.0).to(x.dtype)


def softmax_bwd(g, y, scale: float) -> torch.Tensor:
    acc = _acc(y)
    g, yy = g.to(acc), y.to(acc)
    return (scale * yy * (g - (g * yy).sum(-1, keepdim=True))).to(y.dtype)


def _mul32(a: torch.Tensor, c: int) -> torch.Tensor:
    """(a * c) mod 2**32 for 0 <= a < 2**32 in int64, without overflow: 16-bit halves."""
    return ((a & 0xFFFF) * c + ((((a >> 16) * c) & 0xFFFF) << 16)) & _M32


def _mix32(h: torch.Tensor) -> torch.Tensor:          # bias_dropout_add.cu's mix32, bit for bit
    h = h ^ (h >> 16)
    h = _mul32(h, 0x7FEB352D)
    h = h ^ (h >> 15)
    h = _mul32(h, 0x846CA68B)
    return h ^ (h >> 16)


def keep_mask(shape: torch.Size, p: float, seed: int, device) -> torch.Tensor:
    """The dropout keep mask of bias_dropout_add.cu: element i kept when hash(seed, i) >= p."""
    i = torch.arange(math.prod(shape), dtype=torch.int64, device=device)
    h = _mix32((seed & _M32) ^ _mix32(((i & _M32) + _mix32((i >> 32) & _M32)) & _M32))
    u = (h >> 8).to(torch.float32) * (1.0 / 16777216.0)
    return (u >= torch.tensor(p, dtype=torch.float32)).view(shape)


def bias_dropout_add_fwd(x, b, residual, p: float, seed: int) -> torch.Tensor:
    out = result_dtype(x, b, residual)
    acc = _acc(out)
    v = x.to(acc) + _up(b, acc)
    if p > 0 and v.shape != residual.shape:
        raise ValueError(f"bias_dropout_add with p > 0 needs x + bias {tuple(v.shape)} shaped like the "
                         f"residual {tuple(residual.shape)}")
    if p > 0:
        v = torch.where(keep_mask(x.shape, p, seed, x.device), v / (1 - p), 0.0) if p < 1 else v * 0
    return (residual.to(acc) + v).to(out)


def bias_dropout_add_bwd(g, p: float, seed: int) -> torch.Tensor:
    if p == 0:
        return g.clone()
    if p >= 1:
        return torch.zeros_like(g)
    return torch.where(keep_mask(g.shape, p, seed, g.device), g.to(_acc(g)) / (1 - p), 0.0).to(g.dtype)


def norm_fwd(x, w, b, eps: float, rms: bool):
    acc = _acc(x)
    xf = x.to(acc)
    mean = torch.zeros(x.shape[:-1], dtype=acc, device=x.device) if rms else xf.mean(-1)
    var = ((xf - mean.unsqueeze(-1)) ** 2).mean(-1)
    rstd = torch.rsqrt(var + eps)
    y = (xf - mean.unsqueeze(-1)) * rstd.unsqueeze(-1)
    if w is not None:
        y = y * w.to(acc)
    if b is not None:
        y = y + b.to(acc)
    stat = torch.float64 if acc == torch.float64 else torch.float32
    return y.to(x.dtype), mean.to(stat), rstd.to(stat)


def norm_bwd(g, x, w, mean, rstd, rms: bool):
    """(dx, dw, db): dw and db summed over every leading dim, in the accumulation dtype."""
    acc = _acc(x)
    gf, xh = g.to(acc), (x.to(acc) - mean.unsqueeze(-1).to(acc)) * rstd.unsqueeze(-1).to(acc)
    gw = gf * (w.to(acc) if w is not None else 1.0)
    m1 = 0.0 if rms else gw.mean(-1, keepdim=True)
    dx = rstd.unsqueeze(-1).to(acc) * (gw - m1 - xh * (gw * xh).mean(-1, keepdim=True))
    lead = tuple(range(x.dim() - 1))
    if not lead:                                     # a single row: sum(()) would sum every dim
        return dx.to(x.dtype), gf * xh, gf.clone()
    return dx.to(x.dtype), (gf * xh).sum(lead), gf.sum(lead)


def rope_apply(x, cos, sin, inverse: bool, half: int) -> torch.Tensor:
    """x [b, h, s, d]; cos, sin [1 or b, s, d] shared by the heads; the rotation pairs the two parts
    of d split at `half` (d / 2 in every model we know). inverse: the backward (the transpose)."""
    if x.dim() != 4 or not 0 < half < x.shape[-1]:
        raise ValueError(f"rotary: x {tuple(x.shape)} must be [b, heads, s, d] with 0 < half ({half}) < d")
    out = result_dtype(x, cos, sin)                  # x * cos promotes, as the unfused code does
    acc, d = _acc(out), x.shape[-1]
    xf, c, s = x.to(acc), cos.to(acc).unsqueeze(1), sin.to(acc).unsqueeze(1)
    if not inverse:
        rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1) * s
    else:                                            # the transpose of x -> cat([-x[h:], x[:h]]) * s
        xs = xf * s
        rotated = torch.cat([xs[..., d - half:], -xs[..., :d - half]], dim=-1)
    return (xf * c + rotated).to(out)
