"""What the ops of a rank graph that read values, or pick a kernel by device, become when the rank
runs on meta tensors (planning/meta_rank.py): a meta tensor has a shape and no values, and torch
runs every op on it through its meta kernel, whatever device the rank will run on.

    swaps = on_meta(torch.device("cpu"))     # graph function -> stand-in, for a rank run on the CPU

- Whether a mask is the causal triangle (kernels/attention.py's `is_causal_mask`) is read from its
  values: on meta it is taken to be, as in the training batches of a causal language model without
  padding; attention then takes its causal path and saves what that path saves.
- Scaled dot-product attention picks its kernel by device, dtype, dropout and mask (flash, memory
  efficient or the written-out math, which saves the s x s scores). On meta torch always writes it
  out: `sdpa_on(device)` asks torch which kernel it would pick on `device` for these shapes (on
  stand-ins of the same shapes and strides that hold one row of memory) and runs that kernel's meta
  version, so the tensors saved for backward are that kernel's. A GPU planned from a machine
  without one is taken to pick flash attention (16-bit, no mask) or the memory-efficient kernel.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend

from autoshard.kernels.attention import attention, is_causal_mask

__all__ = ["SDPA_OPS", "on_meta", "sdpa_on"]

SDPA_OPS = (torch.ops.aten.scaled_dot_product_attention.default, F.scaled_dot_product_attention)


def _causal_on_meta(mask: torch.Tensor) -> bool:
    return mask.dim() >= 2


def _probe(t: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    """A tensor of t's shape, dtype and last-dim stride on `device`, holding one row."""
    if t is None:
        return None
    return torch.empty(t.shape[-1], dtype=t.dtype, device=device).expand(t.shape)


def _choice(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, device: torch.device) -> SDPBackend:
    """The kernel SDPA picks on `device`: torch's own choice where that device is here, else (a GPU
    planned from a machine without one) flash attention for 16-bit inputs without a mask, the
    memory-efficient kernel otherwise (fp32, or a mask): what CUDA picks on current GPUs."""
    if device.type == "cpu" or (device.type == "cuda" and torch.cuda.is_available()):
        probes = [_probe(t, device) for t in (q, k, v, attn_mask)]
        return SDPBackend(torch._fused_sdp_choice(*probes, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa))
    if device.type != "cuda":
        return SDPBackend.MATH
    if attn_mask is None and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-3] == k.shape[-3]:
        return SDPBackend.FLASH_ATTENTION
    return SDPBackend.EFFICIENT_ATTENTION


def sdpa_on(device: torch.device) -> Callable[..., torch.Tensor]:
    """F.scaled_dot_product_attention for meta tensors, running the kernel `device` would pick
    (the CPU's flash kernel, CUDA's flash or memory-efficient one, else the written-out math;
    grouped key/value heads go to the math path unless the flash kernel takes them)."""
    def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        choice = SDPBackend.MATH if q.device.type != "meta" else \
            _choice(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, device)
        if choice == SDPBackend.FLASH_ATTENTION and device.type == "cpu":
            return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q, k, v, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)[0]
        if choice == SDPBackend.FLASH_ATTENTION:
            return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, scale=scale)[0]
        if choice == SDPBackend.EFFICIENT_ATTENTION and q.shape[-3] == k.shape[-3]:
            return torch.ops.aten._scaled_dot_product_efficient_attention(
                q, k, v, attn_mask, True, dropout_p, is_causal, scale=scale)[0]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p,
                                              is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
    return sdpa


def on_meta(device: torch.device) -> dict[object, Callable]:
    """Graph function -> its stand-in on meta tensors, for a rank that will run on `device`."""
    sdpa = sdpa_on(device)

    def attention_on_meta(*args, **kwargs):
        return attention(*args, **kwargs, sdpa=sdpa)
    return {is_causal_mask: _causal_on_meta, attention: attention_on_meta,
            **{op: sdpa for op in SDPA_OPS}}
