"""Weights a trained model has, not the ones it was built with.

A model's own initial weights hide whole kinds of bug: every Hugging Face bias starts at 0 and every
norm weight at 1, so a bias added on every tensor-parallel rank before the all-reduce (counted tp
times), or a norm weight applied twice, changes nothing. Each parameter is moved, seeded, away from
its initial value before anything is compiled: a tensor whose elements differ by a quarter of their
spread, a constant one (zeros, ones, a scalar gain) by a tenth of its size (at least 0.1). Every row
moves, the embedding's first and last rows of each vocabulary shard too.
"""
from __future__ import annotations

import torch
from torch import nn

__all__ = ["perturb_weights", "SPREAD", "CONSTANT"]

SPREAD = 0.25       # noise per element, as a fraction of the tensor's standard deviation
CONSTANT = 0.1      # for a tensor whose elements are all equal: a fraction of max(|value|, 1)


def perturb_weights(model: nn.Module, seed: int = 0) -> int:
    """Move every floating parameter of `model` in place (see the module doc); returns how many.
    Tied parameters move once (named_parameters gives each tensor once)."""
    gen = torch.Generator().manual_seed(seed)
    moved = 0
    with torch.no_grad():
        for _, p in model.named_parameters():
            if not p.is_floating_point() or p.is_meta or p.numel() == 0:
                continue
            wide = p.detach().to(torch.float64)
            spread = float(wide.std()) if p.numel() > 1 else 0.0
            scale = SPREAD * spread if spread > 0 else CONSTANT * max(abs(float(wide.flatten()[0])), 1.0)
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p.device) * scale
            p.copy_((wide + noise).to(p.dtype))
            moved += 1
    return moved
