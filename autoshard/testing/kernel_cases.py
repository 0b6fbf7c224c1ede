"""The fused ops as cases for the kernel checks and the kernel benchmark: fresh random inputs of a
shape, the fused op, the same function as plain torch code (what a model writes, what eager and
torch.compile run), and the fewest bytes a forward and a backward must move through memory (each
input read once, each output written once).

    case = CASES["bias_gelu_tanh"]
    inputs = case.make((8, 1024), torch.bfloat16, "cuda", torch.Generator("cuda").manual_seed(0))
    y = case.fused(**inputs)           # torch.ops.autoshard.bias_gelu
    y0 = case.eager(**inputs)          # F.gelu(x + bias, approximate="tanh")
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from autoshard.kernels import ops

__all__ = ["KernelCase", "CASES", "make_inputs"]

Shape = tuple[int, ...]
Inputs = dict[str, Any]

# rows x cols of element-wise and row-wise ops: one element, tails shorter than a 16-byte pack,
# odd widths, widths that are a pack multiple, more than one dim of rows
ROW_SHAPES: tuple[Shape, ...] = ((1, 1), (3, 7), (8, 1024), (17, 1000), (2, 3, 4099), (257, 1536))
# a norm over one or two elements has a gradient that is all cancellation (LayerNorm's is exactly 0),
# where a relative error says nothing: norms start at three
NORM_SHAPES: tuple[Shape, ...] = ((1, 3), *ROW_SHAPES[1:])
# [batch, heads, seq, seq] scores and [batch, heads, seq, head dim] q/k
SCORE_SHAPES: tuple[Shape, ...] = ((1, 1, 1, 1), (2, 3, 7, 7), (1, 2, 33, 33), (2, 4, 128, 128), (1, 2, 5, 1000))
HEAD_SHAPES: tuple[Shape, ...] = ((1, 1, 1, 2), (2, 3, 7, 6), (1, 2, 33, 64), (2, 4, 128, 128), (1, 3, 5, 80))
SCALE, EPS, P_DROP = 0.125, 1e-5, 0.1


@dataclass(frozen=True)
class KernelCase:
    name: str
    make: Callable[[Shape, torch.dtype, torch.device, torch.Generator], Inputs]
    fused: Callable[..., torch.Tensor]
    eager: Callable[..., torch.Tensor]
    grads: tuple[str, ...]              # the inputs gradients flow to
    shapes: tuple[Shape, ...]           # shapes the checks run
    bench: tuple[Shape, ...]            # shapes the benchmark times (transformer sizes, many times the L2)
    fwd_bytes: Callable[[Inputs], int]
    bwd_bytes: Callable[[Inputs], int]  # reads the output's gradient and what the backward needs, writes the grads
    same_as_eager: bool = True          # False where the fused op draws its own dropout mask


def _randn(shape: Shape, dtype: torch.dtype, device, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=gen, device=device).to(dtype)


def _nb(*ts: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in ts if t is not None)


def make_inputs(case: KernelCase, shape: Shape, dtype: torch.dtype, device, seed: int) -> Inputs:
    """Fresh inputs from `seed`; the tensors in `case.grads` are leaves that require grad."""
    device = torch.device(device)
    gen = torch.Generator(device).manual_seed(seed)
    inputs = case.make(shape, dtype, device, gen)
    return {k: v.detach().requires_grad_() if k in case.grads else v for k, v in inputs.items()}


# ---- bias + GeLU --------------------------------------------------------------------------------
def _bias_gelu_case(approximate: str) -> KernelCase:
    def make(shape, dtype, device, gen):
        return {"x": _randn(shape, dtype, device, gen), "bias": _randn(shape[-1:], dtype, device, gen)}
    return KernelCase(
        f"bias_gelu_{'tanh' if approximate == 'tanh' else 'erf'}", make,
        fused=lambda x, bias: ops.bias_gelu(x, bias, approximate),
        eager=lambda x, bias: F.gelu(x + bias, approximate=approximate),
        grads=("x", "bias"), shapes=ROW_SHAPES, bench=((16384, 8192), (8192, 5120)),
        fwd_bytes=lambda i: _nb(i["x"], i["bias"], i["x"]),
        bwd_bytes=lambda i: _nb(i["x"], i["x"], i["bias"], i["x"], i["bias"]))     # g, x, b -> dx, db


# ---- SwiGLU -------------------------------------------------------------------------------------
def _swiglu_make(halves: bool):
    def make(shape, dtype, device, gen):
        if halves:      # gate and up: the two halves of one [.., 2n] projection (strided views)
            gate, up = _randn((*shape[:-1], 2 * shape[-1]), dtype, device, gen).chunk(2, -1)
            return {"gate": gate, "up": up, "gate_bias": _randn(shape[-1:], dtype, device, gen),
                    "up_bias": _randn(shape[-1:], dtype, device, gen)}
        return {"gate": _randn(shape, dtype, device, gen), "up": _randn(shape, dtype, device, gen),
                "gate_bias": None, "up_bias": None}
    return make


def _swiglu_case(halves: bool) -> KernelCase:
    return KernelCase(
        "swiglu_bias_halves" if halves else "swiglu", _swiglu_make(halves),
        fused=lambda gate, up, gate_bias, up_bias: ops.swiglu(gate, up, gate_bias, up_bias),
        eager=lambda gate, up, gate_bias, up_bias: (
            F.silu(gate if gate_bias is None else gate + gate_bias) * (up if up_bias is None else up + up_bias)),
        grads=("gate", "up", "gate_bias", "up_bias") if halves else ("gate", "up"),
        shapes=ROW_SHAPES, bench=((16384, 5632), (8192, 11008)),
        fwd_bytes=lambda i: _nb(i["gate"], i["up"], i["gate_bias"], i["up_bias"], i["gate"]),
        bwd_bytes=lambda i: 2 * _nb(i["gate_bias"], i["up_bias"]) + _nb(*(i["gate"],) * 5))   # g, a, u -> da, du


# ---- scaled masked softmax ----------------------------------------------------------------------
def _causal_off(sq: int, sk: int, device) -> torch.Tensor:
    return torch.ones(sq, sk, dtype=torch.bool, device=device).triu(sk - sq + 1)


def _softmax_make(masked: bool):
    def make(shape, dtype, device, gen):
        b, _, sq, sk = shape
        x = _randn(shape, dtype, device, gen)
        if not masked:
            return {"x": x, "mask": None}
        mask = torch.rand((b, sq, sk), generator=gen, device=device) < 0.3
        mask[:, 1::3, -1] = False           # some rows with an unmasked key, one row fully masked
        mask[:, 0, :] = sq > 2
        return {"x": x, "mask": mask}
    return make


def _softmax_eager(x: torch.Tensor, mask: torch.Tensor | None, causal: bool) -> torch.Tensor:
    off = _causal_off(x.shape[-2], x.shape[-1], x.device) if causal else mask.unsqueeze(1)
    return torch.softmax((x * SCALE).masked_fill(off, float("-inf")), dim=-1)


def _softmax_case(masked: bool) -> KernelCase:
    causal = not masked
    return KernelCase(
        "softmax_mask" if masked else "softmax_causal", _softmax_make(masked),
        fused=lambda x, mask: ops.scaled_masked_softmax(x, mask, SCALE, causal),
        eager=lambda x, mask: _softmax_eager(x, mask, causal),
        grads=("x",), shapes=SCORE_SHAPES, bench=((8, 16, 1024, 1024), (4, 32, 2048, 2048)),
        fwd_bytes=lambda i: _nb(i["x"], i["mask"], i["x"]),
        bwd_bytes=lambda i: _nb(i["x"], i["x"], i["x"]),                            # g, y -> dx
        # a fully masked row is 0 in the fused op and NaN in torch's softmax: compare where defined
        same_as_eager=not masked)


# ---- bias + dropout + residual ------------------------------------------------------------------
def _bda_make(shape, dtype, device, gen):
    return {"x": _randn(shape, dtype, device, gen), "bias": _randn(shape[-1:], dtype, device, gen),
            "residual": _randn(shape, dtype, device, gen), "seed": 1234}


BIAS_DROPOUT_ADD = KernelCase(
    "bias_dropout_add", _bda_make,
    fused=lambda x, bias, residual, seed: ops.bias_dropout_add(x, bias, residual, P_DROP, seed=seed),
    eager=lambda x, bias, residual, seed: residual + F.dropout(x + bias, P_DROP, training=True),
    grads=("x", "bias", "residual"), shapes=ROW_SHAPES, bench=((16384, 2048), (8192, 12288)),
    fwd_bytes=lambda i: _nb(i["x"], i["bias"], i["residual"], i["x"]),
    bwd_bytes=lambda i: _nb(i["x"], i["x"], i["bias"]),         # g -> dx, db (d residual is g itself)
    same_as_eager=False)


# ---- LayerNorm / RMSNorm ------------------------------------------------------------------------
def _norm_make(with_bias: bool):
    def make(shape, dtype, device, gen):
        w = 1 + 0.1 * _randn(shape[-1:], torch.float32, device, gen)
        inputs = {"x": _randn(shape, dtype, device, gen), "weight": w.to(dtype)}
        if with_bias:
            inputs["bias"] = _randn(shape[-1:], dtype, device, gen)
        return inputs
    return make


def _rms_norm_eager(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Llama's RMSNorm as Hugging Face writes it."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)
    return weight * h.to(x.dtype)


def _rows(i: Inputs) -> int:
    return i["x"].numel() // i["x"].shape[-1]


LAYER_NORM = KernelCase(
    "layer_norm", _norm_make(True),
    fused=lambda x, weight, bias: ops.layer_norm(x, weight, bias, EPS),
    eager=lambda x, weight, bias: F.layer_norm(x, x.shape[-1:], weight, bias, EPS),
    grads=("x", "weight", "bias"), shapes=NORM_SHAPES, bench=((16384, 2048), (8192, 12288)),
    fwd_bytes=lambda i: _nb(i["x"], i["weight"], i["bias"], i["x"]) + 8 * _rows(i),      # + mean, rstd
    bwd_bytes=lambda i: _nb(i["x"], i["x"], i["weight"], i["x"], i["weight"], i["bias"]) + 8 * _rows(i))

RMS_NORM = KernelCase(
    "rms_norm", _norm_make(False),
    fused=lambda x, weight: ops.rms_norm(x, weight, EPS),
    eager=_rms_norm_eager,
    grads=("x", "weight"), shapes=NORM_SHAPES, bench=((16384, 4096), (8192, 8192)),
    fwd_bytes=lambda i: _nb(i["x"], i["weight"], i["x"]) + 4 * _rows(i),                  # + rstd
    bwd_bytes=lambda i: _nb(i["x"], i["x"], i["weight"], i["x"], i["weight"]) + 4 * _rows(i))


# ---- rotary -------------------------------------------------------------------------------------
def _rotary_make(shape, dtype, device, gen):
    _, _, s, d = shape
    inv = 1.0 / 10000 ** (torch.arange(0, d, 2, device=device).float() / d)
    angles = torch.arange(s, device=device).float()[:, None] * inv[None, :]      # [s, d/2]
    angles = torch.cat([angles, angles], -1)[None]                                # [1, s, d]
    return {"x": _randn(shape, dtype, device, gen), "cos": angles.cos().to(dtype), "sin": angles.sin().to(dtype)}


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, -1)
    return torch.cat([-b, a], -1)


ROTARY = KernelCase(
    "rotary", _rotary_make,
    fused=lambda x, cos, sin: torch.ops.autoshard.rotary(x, cos, sin, False, x.shape[-1] // 2),
    eager=lambda x, cos, sin: x * cos.unsqueeze(1) + _rotate_half(x) * sin.unsqueeze(1),
    grads=("x",), shapes=HEAD_SHAPES, bench=((8, 16, 2048, 128), (4, 32, 4096, 128)),
    fwd_bytes=lambda i: _nb(i["x"], i["cos"], i["sin"], i["x"]),
    bwd_bytes=lambda i: _nb(i["x"], i["cos"], i["sin"], i["x"]))


CASES: dict[str, KernelCase] = {c.name: c for c in (
    _bias_gelu_case("tanh"), _bias_gelu_case("none"), _swiglu_case(True), _swiglu_case(False),
    _softmax_case(False), _softmax_case(True), BIAS_DROPOUT_ADD, LAYER_NORM, RMS_NORM, ROTARY)}
