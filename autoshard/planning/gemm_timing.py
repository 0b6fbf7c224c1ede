"""Seconds per kernel: GEMMs by tile and wave quantization, elementwise kernels by bytes moved.

A transformer layer is two tables: its GEMMs (shape per tensor-parallel rank) and its
memory-bound kernels (bytes per element, forward and backward, as Megatron fuses them). Adding
a kernel is adding a row.

GEMM model (NVIDIA's "Matrix Multiplication Background" guide): the output is cut into 256x128
tiles, one per streaming multiprocessor at a time; a partial last wave and partial edge tiles
cost full time. The GEMM takes the longer of that and moving its operands at HBM bandwidth.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from autoshard.planning.hardware import Hardware

__all__ = ["LayerShape", "gemm_seconds", "bytes_seconds", "GEMMS", "ELEMENTWISE", "FP8_CAST_BYTES", "layer_gemm_seconds",
           "layer_elementwise_seconds", "layer_elementwise_bytes"]


@dataclass(frozen=True)
class LayerShape:
    """One transformer layer on one tensor-parallel rank for one microbatch."""
    b: int          # microbatch
    s: int          # sequence
    h: int          # hidden
    a: int          # heads
    t: int          # tensor-parallel ranks
    sp: bool = False  # sequence parallel: norms, dropout and residuals see s / t tokens


def gemm_seconds(m: int, n: int, k: int, hw: Hardware, batch: int = 1, fp8: bool = False) -> float:
    """Time of `batch` independent (m x k) @ (k x n) products in fp16/bf16 (`fp8`: float8 operands at
    the FP8 rate, a bf16 result)."""
    tile_m, tile_n = hw.tile
    tiles = math.ceil(m / tile_m) * math.ceil(n / tile_n) * batch
    waves = math.ceil(tiles / hw.sms)
    padded_flops = 2 * waves * hw.sms * tile_m * tile_n * k     # every wave pays for full tiles
    rate = hw.fp8_tflops if fp8 else hw.peak_tflops
    if rate <= 0:
        raise ValueError(f"{hw.name} has no FP8 tensor cores (fp8_tflops=0)")
    compute = padded_flops / (rate * 1e12 * hw.matmul_efficiency)
    if not hw.gemm_traffic:      # a rate measured on these shapes already includes the operands' traffic
        return compute
    operand = 1 if fp8 else hw.activation_bytes
    traffic = batch * (operand * (m * k + k * n) + hw.activation_bytes * m * n)
    return max(compute, bytes_seconds(traffic, hw))


def bytes_seconds(nbytes: float, hw: Hardware) -> float:
    return nbytes / (hw.hbm_gb_s * 1e9 * hw.memory_efficiency)


# (name, (m, n, k, batch) of the forward product; attention core: recomputed by selective recompute)
_Gemm = tuple[str, Callable[[LayerShape], tuple[int, int, int, int]], bool]
GEMMS: list[_Gemm] = [
    ("qkv", lambda x: (x.b * x.s, 3 * x.h // x.t, x.h, 1), False),
    ("scores", lambda x: (x.s, x.s, x.h // x.a, x.b * x.a // x.t), True),       # q k^T per head
    ("context", lambda x: (x.s, x.h // x.a, x.s, x.b * x.a // x.t), True),      # probs v per head
    ("proj", lambda x: (x.b * x.s, x.h, x.h // x.t, 1), False),
    ("fc1", lambda x: (x.b * x.s, 4 * x.h // x.t, x.h, 1), False),
    ("fc2", lambda x: (x.b * x.s, x.h, 4 * x.h // x.t, 1), False),
]

# Element counts per layer and microbatch on one rank.
_COUNTS: dict[str, Callable[[LayerShape], float]] = {
    "tokens": lambda x: x.b * x.s * x.h / (x.t if x.sp else 1),    # norms, dropout, residual
    "tokens_tp": lambda x: x.b * x.s * x.h / x.t,                   # split by heads or columns
    "mlp": lambda x: 4 * x.b * x.s * x.h / x.t,
    "scores": lambda x: x.b * x.a / x.t * x.s * x.s,
}

# (name, count, fwd bytes/element, bwd bytes/element, attention core); fp16 values, 1-byte masks.
ELEMENTWISE: list[tuple[str, str, float, float, bool]] = [
    ("input_layernorm", "tokens", 4, 6, False),           # read x, write y | read x, dy, write dx
    ("scale_mask_softmax", "scores", 4, 6, True),          # fused: read, write | read y, dy, write dx
    ("attention_dropout", "scores", 5, 5, True),           # read, write, mask | read dy, mask, write
    ("context_permute", "tokens_tp", 4, 4, True),          # [b, heads, s, d] -> [s, b, heads * d]
    ("attn_bias_dropout_add", "tokens", 7, 5, False),      # read x, residual, write, mask | dy, mask, dx
    ("post_attention_layernorm", "tokens", 4, 6, False),
    ("bias_gelu", "mlp", 4, 6, False),
    ("mlp_bias_dropout_add", "tokens", 7, 5, False),
]


# FP8 linears' casts per element of each cast tensor: its amax read (2 bytes), then read again and
# written as float8 (2 + 1): forward x and w, backward the output gradient (the tensorwise recipe
# reuses the forward's float8 x and w; rowwise recasts them along the other dim, not counted)
FP8_CAST_BYTES = 5


def layer_gemm_seconds(x: LayerShape, hw: Hardware, *, attention_core_only: bool = False,
                       fp8: bool = False) -> tuple[float, float]:
    """(forward, backward) GEMM seconds; backward is the data-gradient and weight-gradient products.
    `fp8`: the linears (not attention's core products) in float8, with their casts' traffic."""
    fwd = bwd = 0.0
    for _, shape, core in GEMMS:
        if attention_core_only and not core:
            continue
        mm, n, k, batch = shape(x)
        eight = fp8 and not core
        fwd += gemm_seconds(mm, n, k, hw, batch, eight)
        bwd += gemm_seconds(mm, k, n, hw, batch, eight) + gemm_seconds(k, n, mm, hw, batch, eight)
        if eight:
            fwd += bytes_seconds(FP8_CAST_BYTES * (mm * k + k * n), hw)
            bwd += bytes_seconds(FP8_CAST_BYTES * mm * n, hw)
    return fwd, bwd


def layer_elementwise_bytes(x: LayerShape, activation_bytes: int = 2, *,
                            attention_core_only: bool = False) -> tuple[float, float]:
    """(forward, backward) bytes the ELEMENTWISE table moves for one layer and microbatch."""
    fwd = bwd = 0.0
    scale = activation_bytes / 2          # the table counts 2-byte values
    for _, count, f, bw, core in ELEMENTWISE:
        if attention_core_only and not core:
            continue
        n = _COUNTS[count](x) * scale
        fwd += f * n
        bwd += bw * n
    return fwd, bwd


def layer_elementwise_seconds(x: LayerShape, hw: Hardware, *,
                              attention_core_only: bool = False) -> tuple[float, float]:
    fwd, bwd = layer_elementwise_bytes(x, hw.activation_bytes, attention_core_only=attention_core_only)
    return bytes_seconds(fwd, hw), bytes_seconds(bwd, hw)
