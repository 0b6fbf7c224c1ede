"""Context parallelism in the cost model: a layer's extra attention work and its ring's exposed time.

With cp ranks each holding s / cp tokens (load-balanced pieces: every rank does the same causal
work), a rank's GEMMs and element-wise kernels are those of an s / cp sequence (the caller's
LayerShape), but its attention core meets all s keys: cp blocks of (s / cp)^2 scores, of which the
LayerShape counts one. Ring attention sends each key/value block cp - 1 times in forward, and in
backward the blocks again plus their dk / dv (twice the bytes); each step's send either overlaps
the block's compute (exposed: what is left of it) or follows it (`overlap=False`).

    >>> from autoshard.planning.gemm_timing import LayerShape
    >>> from autoshard.planning.hardware import get_hardware
    >>> x = LayerShape(b=1, s=65536, h=4096, a=32, t=4)
    >>> r = ring_seconds(x, get_hardware("h100-80gb"), cp=2, kv_heads=8, recompute="none")
    >>> r.comm_exposed < r.comm_total
    True
"""
from __future__ import annotations

from dataclasses import dataclass

from autoshard.planning.gemm_timing import LayerShape, layer_gemm_seconds
from autoshard.planning.hardware import Hardware

__all__ = ["RingCost", "ring_seconds", "choose_attention"]


@dataclass(frozen=True)
class RingCost:
    forward: float          # extra attention-core compute in forward (the cp - 1 other blocks)
    backward: float         # ... in backward, with the recomputed forward's
    comm_total: float       # every ring send of one layer and microbatch, forward and backward
    comm_exposed: float     # the part of it not hidden behind the blocks' compute


def ring_seconds(x: LayerShape, hw: Hardware, *, cp: int, kv_heads: int | None = None, recompute: str = "none",
                 overlap: bool = True, link_gb_s: float | None = None) -> RingCost:
    """One layer's context-parallel costs for one microbatch (`x.s` is the rank's s / cp tokens)."""
    if cp == 1:
        return RingCost(0.0, 0.0, 0.0, 0.0)
    core_f, core_b = layer_gemm_seconds(x, hw, attention_core_only=True)       # one (s/cp)^2 block
    refwd = core_f if recompute in ("full", "selective") else 0.0
    kv = (kv_heads or x.a) * (x.h // x.a) // x.t                               # this rank's kv features
    block = 2 * x.b * x.s * kv * hw.activation_bytes                            # k and v of s / cp tokens
    link = (link_gb_s or hw.nvlink_gb_s) * 1e9 * hw.network_efficiency
    send = hw.latency_us * 1e-6 + block / link
    steps = cp - 1
    passes_f = 2 if recompute in ("full", "selective") else 1                   # the recomputed forward's ring
    total = steps * (passes_f * send + 2 * send)
    if overlap:
        exposed = steps * (passes_f * max(0.0, send - core_f) + max(0.0, 2 * send - core_b))
    else:
        exposed = total
    return RingCost(steps * core_f, steps * (core_b + refwd), total, exposed)


def choose_attention(*, batch: int, seq: int, heads: int, kv_heads: int, head_dim: int, cp: int, tp: int = 1,
                     hw: Hardware) -> str:
    """"ring" or "all_gather" for one attention call of this shape: the one whose communication
    leaves less of the layer's time exposed. The all-gather moves the same bytes in one collective
    before the attention (and a reduce-scatter after it in backward), hidden behind nothing; the
    ring moves them in cp - 1 steps, each behind a block's compute. Short sequences (latency,
    little compute per block) and few key/value heads favour the all-gather."""
    if cp == 1:
        return "ring"
    x = LayerShape(b=batch, s=seq // cp, h=heads * head_dim, a=heads, t=tp)
    ring = ring_seconds(x, hw, cp=cp, kv_heads=kv_heads).comm_exposed
    kv_bytes = 2 * batch * seq * (kv_heads // tp if kv_heads >= tp else 1) * head_dim * hw.activation_bytes
    link = hw.nvlink_gb_s * 1e9 * hw.network_efficiency
    # k and v each: an all-gather in forward, a reduce-scatter in backward
    gather = 4 * hw.latency_us * 1e-6 + 2 * kv_bytes * (cp - 1) / cp / link
    return "all_gather" if gather < ring else "ring"
