"""Megatron's tensor-parallel layers written by hand: the baseline autoshard is measured against.

Each collective is the one Megatron issues and nothing more: f before a column-parallel GEMM,
g after a row-parallel one, one all-reduce for the vocabulary-parallel embedding and three
small ones (max, sum of exponentials, target logit) for the vocabulary-parallel cross-entropy.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

__all__ = ["copy_to_tp", "reduce_from_tp", "ColumnParallelLinear", "RowParallelLinear",
           "VocabParallelEmbedding", "vocab_parallel_cross_entropy"]


class _CopyToTP(torch.autograd.Function):
    """Megatron's f: identity forward, all-reduce of the gradient backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """Megatron's g: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def copy_to_tp(x: torch.Tensor, group) -> torch.Tensor:
    return _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group) -> torch.Tensor:
    return _ReduceFromTP.apply(x, group)


class _ShardLinear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group):
        super().__init__()
        self.weight = nn.Parameter(weight.detach().clone())
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone())
        self.group = group


class ColumnParallelLinear(_ShardLinear):
    """y_r = f(x) A_r^T + b_r: this rank's rows of A (output features); output stays split."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(copy_to_tp(x, self.group), self.weight, self.bias)


class RowParallelLinear(_ShardLinear):
    """y = g(x_r B_r^T) + b: this rank's columns of B (input features); the bias is added once."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = reduce_from_tp(F.linear(x, self.weight), self.group)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Rows [start, start + n) of the table; other ids look up zeros; g sums the ranks' parts."""

    def __init__(self, weight: torch.Tensor, start: int, group):
        super().__init__()
        self.weight = nn.Parameter(weight.detach().clone())
        self.start, self.group = start, group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        return reduce_from_tp(x.masked_fill(outside.unsqueeze(-1), 0.0), self.group)


class _VocabParallelCE(torch.autograd.Function):
    """Mean cross-entropy over logits split by vocabulary: three all-reduces of (tokens,) sizes."""

    @staticmethod
    def forward(ctx, logits, target, start, group):
        if logits.dtype in (torch.float16, torch.bfloat16):
            logits = logits.float()                        # the softmax in fp32, as Megatron does
        top = logits.max(dim=-1).values
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - top.unsqueeze(-1)
        local = target - start
        outside = (local < 0) | (local >= logits.shape[-1])
        local = local.masked_fill(outside, 0)
        picked = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        exp = shifted.exp()
        total = exp.sum(dim=-1)
        both = torch.stack([picked, total])              # one all-reduce for the two (tokens,) vectors
        dist.all_reduce(both, group=group)
        picked, total = both
        ctx.save_for_backward(exp.div_(total.unsqueeze(-1)), local, outside)
        return (total.log() - picked).mean()

    @staticmethod
    def backward(ctx, grad):
        softmax, local, outside = ctx.saved_tensors
        g = softmax
        rows = torch.arange(g.shape[0], device=g.device)
        g[rows, local] -= (~outside).to(g.dtype)
        return g.mul_(grad / g.shape[0]), None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, start: int, group) -> torch.Tensor:
    """logits (tokens, V/t) of this rank's vocabulary rows starting at `start`; target (tokens,)."""
    return _VocabParallelCE.apply(logits, target, start, group)
