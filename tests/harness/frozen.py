"""How users freeze parts of a model before sharding it, for the gradient-path checks: an embedding,
a whole layer, or everything but LoRA adapters (Hu et al. 2021) added to the attention's q and v."""
from __future__ import annotations

import torch
from torch import nn

__all__ = ["FREEZES", "LoRALinear", "freeze"]

FREEZES = ("embedding", "layer", "lora")


class LoRALinear(nn.Module):
    """base(x) + (x A^T) B^T * scale, with the base frozen; B starts at zero as in the paper, so the
    first step's output is the base's. `seed` makes A the same in every process."""

    def __init__(self, base: nn.Linear, rank: int = 4, alpha: float = 8.0, seed: int = 0):
        super().__init__()
        self.base = base
        gen = torch.Generator().manual_seed(seed)
        dtype = base.weight.dtype
        self.lora_a = nn.Parameter(torch.randn(rank, base.in_features, generator=gen).to(dtype) / base.in_features ** 0.5)
        self.lora_b = nn.Parameter(torch.zeros(base.out_features, rank, dtype=dtype))
        self.scale = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.lora_a.t()) @ self.lora_b.t() * self.scale


def _embedding(model: nn.Module) -> nn.Parameter:
    return model.get_input_embeddings().weight


def _layers(model: nn.Module) -> nn.ModuleList:
    inner = getattr(model, "model", None) or getattr(model, "transformer")
    return getattr(inner, "layers", None) or getattr(inner, "h")


def freeze(model: nn.Module, how: str) -> nn.Module:
    """Freeze `model` in place as `how` says (one of FREEZES); returns it."""
    if how == "embedding":
        _embedding(model).requires_grad_(False)
    elif how == "layer":
        _layers(model)[0].requires_grad_(False)
    elif how == "lora":
        model.requires_grad_(False)
        for i, layer in enumerate(_layers(model)):
            attn = layer.self_attn
            attn.q_proj = LoRALinear(attn.q_proj, seed=2 * i)
            attn.v_proj = LoRALinear(attn.v_proj, seed=2 * i + 1)
    else:
        raise ValueError(f"unknown freeze {how!r}; choose from {FREEZES}")
    return model
