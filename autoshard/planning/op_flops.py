"""FLOPs of the ops torch.utils.flop_counter's table does not know, and which FLOPs are attention's.

    counted = flops_of(func, args, kwargs, out)      # an OpFlops, or None for an op with no FLOPs

torch's table (`flop_registry`) covers the GPU attention kernels but not the one a CPU run calls
(`_scaled_dot_product_flash_attention_for_cpu`, forward and backward), nor grouped products: the
experts of a mixture-of-experts layer as `aten._grouped_mm`, or as transformers' Python fallback
`transformers.grouped_mm_fallback` (a loop over the experts, one `torch.mm` each, opaque to the
dispatcher). Without these entries a CPU Llama's attention and a Mixtral's experts were timed as
the few bytes of their operands.

Each entry: the op's overload packet name -> (kind, FLOPs from the call's tensors, the dispatches
an opaque op makes inside). Kinds: "attention" (fused attention kernels, whatever table knows
them: planning/graph_time.py times them at the profile's attention rate) and "matmul". Adding an
op is adding a row.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

__all__ = ["OpFlops", "flops_of", "EXTRA_FLOPS"]


@dataclass(frozen=True)
class OpFlops:
    kind: str           # "matmul" or "attention"
    flops: float
    inner_ops: int      # dispatches the op makes inside itself (a Python loop's products and slices)


def _cpu_flash(query, key, value, *args, **kwargs) -> int:
    return sdpa_flop_count(query.shape, key.shape, value.shape)


def _cpu_flash_backward(grad_out, query, key, value, *args, **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out.shape, query.shape, key.shape, value.shape)


def _grouped(a: torch.Tensor, b: torch.Tensor, *args, **kwargs) -> int:
    """Every group's product together: [S, K] x [G, K, N] (groups of rows), [G, M, K] x [G, K, N]
    (a batch) or [M, S] x [S, N] (groups of the reduced dimension)."""
    if a.dim() == 2 and b.dim() == 3:
        return 2 * a.shape[0] * a.shape[1] * b.shape[2]
    if a.dim() == 3:
        return 2 * a.shape[0] * a.shape[1] * a.shape[2] * b.shape[-1]
    return 2 * a.shape[0] * a.shape[1] * b.shape[1]


def _grouped_backward(input, weight, offs, grad_output) -> int:
    return 2 * _grouped(input, weight)           # the input's gradient and the weights'


def _experts(input, weight, *args) -> int:
    return weight.shape[0]


def _no_inner(*args, **kwargs) -> int:
    return 0                                     # a kernel: no dispatches of its own


# name -> (kind, FLOPs, inner dispatches). transformers' fallback loop, per expert: forward slices
# its rows, selects its weight, slices the output and multiplies (4); backward slices and
# transposes for two products (10); both also allocate their zeroed results.
EXTRA_FLOPS: dict[str, tuple[str, Callable[..., int], Callable[..., int]]] = {
    "aten._scaled_dot_product_flash_attention_for_cpu": ("attention", _cpu_flash, _no_inner),
    "aten._scaled_dot_product_flash_attention_for_cpu_backward": ("attention", _cpu_flash_backward, _no_inner),
    "aten._grouped_mm": ("matmul", _grouped, _no_inner),
    "transformers.grouped_mm_fallback": ("matmul", _grouped, lambda *a, **k: 4 * _experts(*a) + 1),
    "transformers.grouped_mm_fallback_backward": ("matmul", _grouped_backward,
                                                  lambda *a, **k: 10 * _experts(*a) + 2),
}


def flops_of(func, args: tuple, kwargs: dict, out) -> OpFlops | None:
    """The FLOPs of one call of `func` (an OpOverload), from torch's table or EXTRA_FLOPS; None for
    an op neither knows."""
    packet = func._overloadpacket
    name = str(packet)
    count = flop_registry.get(packet)
    if count is not None:
        kind = "attention" if "attention" in name else "matmul"
        return OpFlops(kind, count(*args, **kwargs, out_val=out), 0)
    if name in EXTRA_FLOPS:
        kind, flops, inner = EXTRA_FLOPS[name]
        return OpFlops(kind, flops(*args, **kwargs), inner(*args, **kwargs))
    return None
