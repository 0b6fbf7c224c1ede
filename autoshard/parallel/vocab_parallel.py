"""Vocabulary-parallel collectives: gather a vocab-sharded output, and cross-entropy on shards.

The math is written once over a list of ranks' tensors with a `Reducer` (comm.py), so the
torch.distributed run and the simulator run the same code. `CrossEntropySpec` and `GatherSpec` are
what the rewrite emits for the two modules.

Cross-entropy follows Megatron: each rank holds logits for its vocabulary rows only; the global max,
the sum of exponentials and the target logit are each all-reduced as one number per token, so no
rank ever holds [tokens, V] logits, and the backward is softmax minus one-hot on the local rows.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from autoshard.bounds import check_targets
from autoshard.parallel.comm import Collective, CommHandle, Reducer, scatter_into_full, take_from_full

__all__ = ["vocab_cross_entropy", "gather_shards", "VocabParallelCrossEntropy", "GatherFromTensorParallelRegion",
           "VocabShard", "CrossEntropySpec", "GatherSpec"]


@dataclass(frozen=True)
class VocabShard:
    """Rank's vocabulary rows: [start, start + count) of the padded vocabulary; `valid` are < V."""

    start: int
    count: int
    valid: int


class _VocabCE(torch.autograd.Function):
    """One shard-sized buffer per rank: exp(x - max) becomes the softmax, then, in backward, the
    gradient (softmax - one-hot) in place, as Megatron's kernel does."""

    @staticmethod
    def forward(ctx, red: Reducer, shards: list[VocabShard], target: torch.Tensor, ignore_index: int,
                reduction: int, *logits: torch.Tensor):
        # at least fp32 (half-precision logits are upcast, as F.cross_entropy's kernel does), never narrower
        wide = torch.promote_types(logits[0].dtype, torch.float32)
        real = [x[..., :s.valid].to(wide) for x, s in zip(logits, shards)]   # padded rows are not classes
        maxes = red.max([x.amax(-1) if x.shape[-1] else torch.full(x.shape[:-1], float("-inf"))
                         for x in real])
        keep = target != ignore_index
        softmaxes, picked, onehots = [], [], []
        for x, s, m in zip(logits, shards, maxes):
            e = x.to(wide) - m.unsqueeze(-1)          # the one shard-sized buffer
            local = target - s.start
            inside = keep & (local >= 0) & (local < s.valid)
            idx = torch.where(inside, local, torch.zeros_like(local))
            picked.append(torch.where(inside, e.gather(-1, idx.unsqueeze(-1)).squeeze(-1), torch.zeros_like(m)))
            e.exp_()
            e[..., s.valid:] = 0.0
            softmaxes.append(e)
            onehots.append((inside, idx))
        sum_exp = red.sum([e.sum(-1) for e in softmaxes])
        target_logit = red.sum(picked)
        for e, se in zip(softmaxes, sum_exp):
            e.div_(se.unsqueeze(-1))
        losses = [torch.where(keep, se.log() - tl, torch.zeros_like(tl)) for se, tl in zip(sum_exp, target_logit)]
        count = keep.sum()
        if reduction == 1:      # mean over non-ignored targets
            out = [loss.sum() / count for loss in losses]
        elif reduction == 2:
            out = [loss.sum() for loss in losses]
        else:
            out = losses
        ctx.save_for_backward(keep, count, *softmaxes)
        ctx.onehots, ctx.reduction, ctx.dtypes = onehots, reduction, [x.dtype for x in logits]
        return tuple(out)

    @staticmethod
    def backward(ctx, *grads):
        keep, count, *softmaxes = ctx.saved_tensors
        outs = []
        for g, d, (inside, idx), dt in zip(grads, softmaxes, ctx.onehots, ctx.dtypes):
            d.scatter_add_(-1, idx.unsqueeze(-1), -inside.to(d.dtype).unsqueeze(-1))   # in place
            scale = (g / count if ctx.reduction == 1 else g) if ctx.reduction in (1, 2) else g.unsqueeze(-1)
            d.mul_(keep.unsqueeze(-1) * scale)
            outs.append(d.to(dt))
        return (None, None, None, None, None, *outs)


def vocab_cross_entropy(red: Reducer, shards: list[VocabShard], target: torch.Tensor, logits: list[torch.Tensor],
                        *, ignore_index: int = -100, reduction: int = 1) -> list[torch.Tensor]:
    """Cross-entropy of vocab-sharded `logits` (one per rank present) against global `target` ids."""
    return list(_VocabCE.apply(red, shards, target, ignore_index, reduction, *logits))


class _Gather(torch.autograd.Function):
    """All-gather along a vocabulary-sharded dim (forward); backward keeps this rank's rows.
    Equal contiguous chunks in rank order go through all_gather; any other layout (shared or
    strided rows) is placed into a zero buffer and summed, twice the bytes but any layout."""

    @staticmethod
    def forward(ctx, red: Reducer, dim: int, size: int, valid: int, ranges: list, even: bool, *xs: torch.Tensor):
        ctx.args = (dim, size, ranges)
        if even:
            fulls = red.all_gather([x.contiguous() for x in xs], dim)
        else:
            fulls = red.sum([scatter_into_full(x, dim, size, r) for x, r in zip(xs, ranges)])
        return tuple(f.narrow(dim, 0, valid) for f in fulls)

    @staticmethod
    def backward(ctx, *grads):
        dim, size, ranges = ctx.args
        outs = []
        for g, r in zip(grads, ranges):
            pad = list(g.shape)
            pad[dim] = size - g.shape[dim]
            full = torch.cat([g, g.new_zeros(pad)], dim) if pad[dim] else g
            outs.append(take_from_full(full, dim, r))
        return (None, None, None, None, None, None, *outs)


def gather_shards(red: Reducer, dim: int, size: int, valid: int, ranges: list, xs: list[torch.Tensor],
                  even: bool = False):
    return list(_Gather.apply(red, dim, size, valid, ranges, even, *xs))


@dataclass(frozen=True)
class CrossEntropySpec:
    """The rewrite's request for a `VocabParallelCrossEntropy` module named `module`."""

    module: str
    start: int
    count: int
    valid: int
    ignore_index: int
    reduction: int
    vocab_size: int          # the real vocabulary (targets outside it, but ignore_index, raise)

    def build(self, handle: CommHandle) -> "VocabParallelCrossEntropy":
        shard = VocabShard(self.start, self.count, self.valid)
        return VocabParallelCrossEntropy(handle, shard, self.ignore_index, self.reduction, self.vocab_size)


class VocabParallelCrossEntropy(Collective):
    """Cross-entropy over this rank's vocabulary rows; one number per token crosses the group."""

    def __init__(self, handle: CommHandle, shard: VocabShard, ignore_index: int, reduction: int, vocab_size: int):
        super().__init__(handle)
        self.shard, self.ignore_index, self.reduction, self.vocab_size = shard, ignore_index, reduction, vocab_size

    @staticmethod
    def run(red: Reducer, mods: list["VocabParallelCrossEntropy"], rank_args: list[tuple]) -> list[torch.Tensor]:
        m = mods[0]
        target = check_targets(rank_args[0][1], m.vocab_size, m.ignore_index)
        return vocab_cross_entropy(red, [k.shard for k in mods], target, [a[0] for a in rank_args],
                                   ignore_index=m.ignore_index, reduction=m.reduction)

    def extra_repr(self) -> str:
        return f"rows=[{self.shard.start}, {self.shard.start + self.shard.count}), ignore_index={self.ignore_index}"


@dataclass(frozen=True)
class GatherSpec:
    """The rewrite's request for a `GatherFromTensorParallelRegion` module named `module`."""

    module: str
    dim: int
    size: int          # padded global size of the gathered dim
    valid: int         # its real size (what the model returns)
    ranges: tuple[tuple[int, int], ...]
    even: bool = False   # every rank holds one equal contiguous chunk, in rank order: all_gather

    def build(self, handle: CommHandle) -> "GatherFromTensorParallelRegion":
        return GatherFromTensorParallelRegion(handle, self.dim, self.size, self.valid, self.ranges, self.even)


class GatherFromTensorParallelRegion(Collective):
    """All-gather a sharded output to full size (forward); backward keeps this rank's part."""

    def __init__(self, handle: CommHandle, dim: int, size: int, valid: int, ranges, even: bool = False):
        super().__init__(handle)
        self.dim, self.size, self.valid, self.ranges, self.even = dim, size, valid, tuple(ranges), even

    @staticmethod
    def run(red: Reducer, mods: list["GatherFromTensorParallelRegion"], rank_args: list[tuple]) -> list[torch.Tensor]:
        m = mods[0]
        return gather_shards(red, m.dim, m.size, m.valid, [k.ranges for k in mods], [a[0] for a in rank_args], m.even)

    def extra_repr(self) -> str:
        how = "all_gather" if self.even else "sum of placed shards"
        return f"dim={self.dim}, size={self.valid}, rows={list(self.ranges)}, {how}"
