"""A hand-parallel nanoGPT (autoshard.models.GPT) at tensor-parallel degree t, Megatron's way.

Built from the single-device model by slicing its weights, so both programs start identical:
attention is split by heads (rows of q, k and v of c_attn, columns of c_proj), the MLP by its
4h features (rows of c_fc, columns of c_proj), the tied embedding / LM head by vocabulary rows.
"""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from autoshard.models import GPT
from benchmarks.hand_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    copy_to_tp,
    vocab_parallel_cross_entropy,
)

__all__ = ["ParallelGPT"]


def _rows(w: torch.Tensor, rank: int, t: int) -> torch.Tensor:
    return w.chunk(t, dim=0)[rank]


def _qkv_rows(w: torch.Tensor, rank: int, t: int) -> torch.Tensor:
    return torch.cat([_rows(part, rank, t) for part in w.chunk(3, dim=0)])   # q_r, k_r, v_r


def _pair(first: nn.Linear, second: nn.Linear, rows, rank: int, t: int, group):
    """Megatron's pair: `first` split by output rows (taken by `rows`), `second` by input columns."""
    column = ColumnParallelLinear(rows(first.weight, rank, t),
                                  None if first.bias is None else rows(first.bias, rank, t), group)
    return column, RowParallelLinear(second.weight.chunk(t, dim=1)[rank], second.bias, group)


class ParallelAttention(nn.Module):
    def __init__(self, attn, rank: int, t: int, group):
        super().__init__()
        self.qkv, self.proj = _pair(attn.c_attn, attn.c_proj, _qkv_rows, rank, t, group)
        self.heads, self.width = attn.n_head // t, attn.n_embd // t

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = self.qkv(x).split(self.width, dim=2)
        q = q.view(B, T, self.heads, -1).transpose(1, 2)        # (B, nh/t, T, hs)
        k = k.view(B, T, self.heads, -1).transpose(1, 2)        # (B, nh/t, T, hs)
        v = v.view(B, T, self.heads, -1).transpose(1, 2)        # (B, nh/t, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, self.width))   # (B, T, C/t)


class ParallelMLP(nn.Module):
    def __init__(self, mlp, rank: int, t: int, group):
        super().__init__()
        self.fc, self.proj = _pair(mlp.c_fc, mlp.c_proj, _rows, rank, t, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class ParallelBlock(nn.Module):
    def __init__(self, block, rank: int, t: int, group):
        super().__init__()
        self.ln_1 = copy.deepcopy(block.ln_1)
        self.attn = ParallelAttention(block.attn, rank, t, group)
        self.ln_2 = copy.deepcopy(block.ln_2)
        self.mlp = ParallelMLP(block.mlp, rank, t, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class ParallelGPT(nn.Module):
    """Tensor-parallel rank `rank` of `model`; forward(idx, targets) returns this rank's logits
    shard (tokens' vocabulary rows [start, start + V/t)) and the mean loss."""

    def __init__(self, model: GPT, rank: int, t: int, group=None):
        super().__init__()
        cfg = model.config
        if cfg.n_head % t or cfg.vocab_size % t:
            raise ValueError(f"t={t} must divide n_head={cfg.n_head} and vocab_size={cfg.vocab_size}")
        self.group = group if group is not None else dist.group.WORLD
        self.start = rank * cfg.vocab_size // t
        self.wte = VocabParallelEmbedding(_rows(model.wte.weight, rank, t), self.start, self.group)
        self.wpe = nn.Embedding.from_pretrained(model.wpe.weight.detach().clone(), freeze=False)
        self.h = nn.ModuleList(ParallelBlock(b, rank, t, self.group) for b in model.h)
        self.ln_f = copy.deepcopy(model.ln_f)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        T = idx.size(1)
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
        for block in self.h:
            x = block(x)
        logits = F.linear(copy_to_tp(self.ln_f(x), self.group), self.wte.weight)   # tied head, f first
        loss = None
        if targets is not None:
            loss = vocab_parallel_cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), self.start,
                                                self.group)
        return logits, loss
