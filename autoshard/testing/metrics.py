"""Error measures for comparing a sharded program with the single-device model."""
from __future__ import annotations

import torch

__all__ = ["max_rel", "grad_errors", "scaled_errors", "norm_rel"]


def max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|: relative error at the scale of the reference tensor."""
    return ((a.detach() - b.detach()).abs().max() / b.detach().abs().max().clamp_min(1e-30)).item()


def grad_errors(got: dict[str, torch.Tensor | None], ref: dict[str, torch.Tensor]) -> dict[str, float]:
    """Per-parameter relative error. A gradient that is zero in exact arithmetic (a key bias: adding
    a constant to every score leaves softmax unchanged) is float noise on both sides, so each error is
    taken against max(own scale, 1e-3 x the largest gradient of the model)."""
    return scaled_errors(got, ref)


def scaled_errors(got: dict[str, torch.Tensor | None], ref: dict[str, torch.Tensor],
                  floor_frac: float = 1e-3) -> dict[str, float]:
    """max |got - ref| / max(max |ref|, floor_frac x the largest |ref| of all tensors), per name."""
    floor = floor_frac * max(r.abs().max().item() for r in ref.values())
    out = {}
    for name, r in ref.items():
        g = got.get(name)
        if g is None:
            out[name] = float("inf")
            continue
        out[name] = ((g - r).abs().max() / max(r.abs().max().item(), floor)).item()
    return out


def norm_rel(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    """||got - ref|| / ||ref|| over all named tensors together (the model's parameter vector).
    Adam's per-element normalisation turns float noise on near-zero gradients into visible
    steps on a few elements; a norm-wise error reads through them to the model as a whole."""
    diff = sum(((got[n].double() - r.double()) ** 2).sum() for n, r in ref.items())
    return (diff / sum((r.double() ** 2).sum() for r in ref.values())).sqrt().item()
