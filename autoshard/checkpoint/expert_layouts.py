"""Checkpoints that store experts one module each, read into the stacked tensors the model trains.

transformers 5 keeps a MoE layer's experts stacked: `mlp.experts.gate_up_proj` [E, 2I, H] (gate
rows, then up rows) and `mlp.experts.down_proj` [E, H, I]. Published checkpoints (and what
transformers' own `save_pretrained` writes) keep one Linear per expert instead, in one of the
layouts of `LEGACY_EXPERT_LAYOUTS`. One row per convention:

    module_rename   the MoE module's name in the checkpoint ('.mlp.' -> '.block_sparse_moe.' for Mixtral)
    tensors         stacked tensor -> the per-expert tensors concatenated along dim 0 to make one expert

Reading takes only the experts asked for (a rank's experts under expert parallelism) and only
their tensors; the caller slices tensor-parallel rows afterwards.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from autoshard.checkpoint.index import CheckpointError

__all__ = ["ExpertLayout", "LEGACY_EXPERT_LAYOUTS", "legacy_name", "read_legacy_experts"]


@dataclass(frozen=True)
class ExpertLayout:
    module_rename: tuple[str, str] | None
    tensors: dict[str, tuple[str, ...]]


LEGACY_EXPERT_LAYOUTS: tuple[ExpertLayout, ...] = (
    # Mixtral's original checkpoints: block_sparse_moe, w1 (gate), w3 (up), w2 (down)
    ExpertLayout((".mlp.", ".block_sparse_moe."), {"gate_up_proj": ("w1.weight", "w3.weight"),
                                                   "down_proj": ("w2.weight",)}),
    # Qwen2-MoE, Qwen3-MoE, OLMoE: gate_proj / up_proj / down_proj Linear modules per expert
    ExpertLayout(None, {"gate_up_proj": ("gate_proj.weight", "up_proj.weight"), "down_proj": ("down_proj.weight",)}),
)


def _renamed(name: str, layout: ExpertLayout) -> str:
    if layout.module_rename is None:
        return name
    new, old = layout.module_rename
    return name.replace(new, old, 1)


def legacy_name(name: str, stored: set[str]) -> str | None:
    """The checkpoint's name for a plain (not stacked) parameter under a renamed MoE module (Mixtral's
    router: mlp.gate.weight is stored as block_sparse_moe.gate.weight), or None."""
    for layout in LEGACY_EXPERT_LAYOUTS:
        old = _renamed(name, layout)
        if old != name and old in stored:
            return old
    return None


def read_legacy_experts(name: str, shape: list[int], experts: tuple[int, int], stored: set[str],
                        read: Callable[[str], torch.Tensor]) -> torch.Tensor | None:
    """Experts lo..hi-1 of stacked parameter `name` (full shape `shape`), assembled from a checkpoint
    that stores them one module each (`read(key)` gives one stored tensor); None when no layout of
    the table matches the stored names."""
    prefix, _, leaf = name.rpartition(".")
    if not prefix.endswith("experts"):
        return None
    for layout in LEGACY_EXPERT_LAYOUTS:
        parts = layout.tensors.get(leaf)
        base = _renamed(prefix, layout)
        if parts is None or not all(f"{base}.0.{p}" in stored for p in parts):
            continue
        if f"{base}.{shape[0] - 1}.{parts[0]}" not in stored or f"{base}.{shape[0]}.{parts[0]}" in stored:
            count = sum(1 for k in stored if k.startswith(f"{base}.") and k.endswith(f".{parts[0]}"))
            raise CheckpointError(f"{name}: the checkpoint has {count} experts under {base}, the model {shape[0]}")
        lo, hi = experts
        rows = []
        for e in range(lo, hi):
            keys = [f"{base}.{e}.{p}" for p in parts]
            missing = [k for k in keys if k not in stored]
            if missing:
                raise CheckpointError(f"{name}: the checkpoint stores experts one module each but has no {missing[0]}")
            rows.append(torch.cat([read(k) for k in keys], 0))    # one expert: [gate rows; up rows] or [rows]
        out = torch.stack(rows)                                    # [hi - lo, *shape[1:]]
        if list(out.shape[1:]) != list(shape[1:]) or hi > shape[0]:
            raise CheckpointError(f"{name}: experts {lo}..{hi - 1} read from {base}.*.{'/'.join(parts)} come out "
                                  f"{tuple(out.shape)}, the model's tensor is {tuple(shape)}")
        return out
    return None
