"""Seconds of one collective on a link (alpha-beta: a start-up latency plus bytes over the link's
bandwidth at the hardware's network efficiency): ring all-reduce, a layer's tensor-parallel
all-reduce, and expert parallelism's all-to-all."""
from __future__ import annotations

from autoshard.planning.cost_formulas import evaluate
from autoshard.planning.gemm_timing import LayerShape
from autoshard.planning.hardware import Hardware

__all__ = ["allreduce_seconds", "tp_allreduce_seconds", "all_to_all_seconds"]


def allreduce_seconds(nbytes: float, n: int, link_gb_s: float, hw: Hardware) -> float:
    if n == 1:
        return 0.0
    return hw.latency_us * 1e-6 + 2 * (n - 1) / n * nbytes / (link_gb_s * 1e9 * hw.network_efficiency)


def tp_allreduce_seconds(x: LayerShape, hw: Hardware) -> float:
    """One all-reduce of a layer's (b, s, h) output over the tensor-parallel ranks on NVLink."""
    nbytes = evaluate("tp_allreduce_bytes", b=x.b, s=x.s, h=x.h) * hw.activation_bytes / 2   # formula: 2-byte values
    return allreduce_seconds(nbytes, x.t, hw.nvlink_gb_s, hw)


def all_to_all_seconds(nbytes: float, ep: int, link_gb_s: float, hw: Hardware) -> float:
    """`nbytes` leaving each of `ep` ranks (every rank sends and receives at once)."""
    if ep == 1:
        return 0.0
    return hw.latency_us * 1e-6 + nbytes / (link_gb_s * 1e9 * hw.network_efficiency)
