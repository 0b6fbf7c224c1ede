"""A Hugging Face Llama cut by hand into torch.distributed.pipelining stages, and its loss: what the
pipeline benchmarks run beside autoshard's programs of the same model (benchmarks/pipeline_overhead.py,
benchmarks/zero_bubble.py)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["LlamaStage", "shifted_cross_entropy"]


class LlamaStage(nn.Module):
    """Layers [lo, hi) of an HF Llama, with the embedding on the first stage and norm + head on the last."""

    def __init__(self, model: nn.Module, lo: int, hi: int, first: bool, last: bool):
        super().__init__()
        inner = model.model
        self.embed = inner.embed_tokens if first else None
        self.layers = nn.ModuleList(inner.layers[lo:hi])
        self.rotary = inner.rotary_emb
        self.norm, self.head = (inner.norm, model.lm_head) if last else (None, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) if self.embed is not None else x                  # [b, s, hidden]
        positions = torch.arange(h.shape[1], device=h.device)[None]          # [1, s]
        rotary = self.rotary(h, position_ids=positions)
        for layer in self.layers:
            h = layer(h, attention_mask=None, position_ids=positions, position_embeddings=rotary)
        return self.head(self.norm(h)) if self.head is not None else h       # [b, s, vocab] on the last


def shifted_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """HF's causal-LM loss: position i predicts label i + 1, in fp32, mean over the tokens."""
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten())
