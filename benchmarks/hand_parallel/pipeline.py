"""Hand-built pipeline stages of the hand-parallel GPT and the loop that runs a schedule, Megatron's way.

Rank layout is Megatron's (tensor-parallel ranks adjacent): global rank = pp_rank * t + tp_rank.
Stage s of p * v holds layers [s * L / (p v), (s + 1) * L / (p v)) and runs on pipeline rank s % p
as its chunk s // p; the first stage also embeds, the last also runs the final norm, the tied LM
head and the vocabulary-parallel loss. The head's weight on the last stage is a copy of the
embedding's shard, and after backward the two gradients are summed over the "embedding group"
(first and last stage, same tensor-parallel rank), as Megatron does.

Activations between stages have one known shape, (microbatch, seq, hidden), so they travel with no
header: isend for sends (kept until the step ends), a blocking recv into a fresh buffer for receives.
The action order is `autoshard.runtime.schedules` (the schedules are data: GPipe, 1F1B, interleaved 1F1B).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from autoshard.models import GPT
from autoshard.runtime.schedules import make_schedule
from benchmarks.hand_parallel.gpt import ParallelGPT
from benchmarks.hand_parallel.layers import copy_to_tp, vocab_parallel_cross_entropy

__all__ = ["GPTStage", "PipelineGPT"]

_FORWARD, _BACKWARD = 0, 1


class GPTStage(nn.Module):
    """Stage `stage` of `n_stages`, cut from one tensor-parallel rank's ParallelGPT."""

    def __init__(self, par: ParallelGPT, stage: int, n_stages: int):
        super().__init__()
        n = len(par.h)
        if n % n_stages:
            raise ValueError(f"{n} layers do not split evenly into {n_stages} stages")
        per = n // n_stages
        self.first, self.last = stage == 0, stage == n_stages - 1
        self.h = nn.ModuleList(par.h[stage * per:(stage + 1) * per])
        self.group, self.start = par.group, par.start
        if self.first:
            self.wte, self.wpe = par.wte, par.wpe
        if self.last:
            self.ln_f = par.ln_f
            self.head = par.wte.weight if self.first else nn.Parameter(par.wte.weight.detach().clone())

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None) -> torch.Tensor:
        """x: token ids (B, T) on the first stage, else hidden states (B, T, C). Returns hidden
        states, or on the last stage the microbatch's mean loss."""
        if self.first:
            x = self.wte(x) + self.wpe(torch.arange(x.size(1), device=x.device))
        for block in self.h:
            x = block(x)
        if not self.last:
            return x
        logits = nn.functional.linear(copy_to_tp(self.ln_f(x), self.group), self.head)   # (B, T, V/t)
        return vocab_parallel_cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), self.start,
                                            self.group)


def _groups(t: int, p: int, pp_rank: int, tp_rank: int):
    """This rank's tensor-parallel group and embedding group (every rank creates every group)."""
    tp = emb = None
    for i in range(p):
        g = dist.new_group([i * t + k for k in range(t)])
        tp = g if i == pp_rank else tp
    for k in range(t):
        ranks = sorted({k, (p - 1) * t + k})
        g = dist.new_group(ranks) if len(ranks) > 1 else None
        emb = g if k == tp_rank else emb
    return tp, emb


class PipelineGPT(nn.Module):
    """This process's chunks of the hand-parallel GPT at tensor degree t and pipeline degree p.

    `train_step(idx, targets)` cuts the batch into `microbatches`, runs the schedule's actions,
    sums the tied embedding's gradients and returns the batch's mean loss on every rank."""

    def __init__(self, model: GPT, t: int, p: int, *, virtual: int = 1, microbatches: int = 1,
                 schedule: str = "1f1b"):
        super().__init__()
        rank = dist.get_rank()
        if dist.get_world_size() != t * p:
            raise ValueError(f"world size {dist.get_world_size()} is not t={t} x p={p}")
        self.t, self.p, self.v, self.m = t, p, virtual, microbatches
        self.pp_rank, self.tp_rank = divmod(rank, t)
        self.tp_group, self.emb_group = _groups(t, p, self.pp_rank, self.tp_rank)
        par = ParallelGPT(model, self.tp_rank, t, self.tp_group)
        self.n_stages = p * virtual
        self.chunks = nn.ModuleList(GPTStage(par, c * p + self.pp_rank, self.n_stages) for c in range(virtual))
        self.actions = make_schedule(schedule, p, virtual, microbatches)[self.pp_rank]
        self.width = model.config.n_embd

    def _peer(self, stage: int) -> int:
        return stage % self.p * self.t + self.tp_rank

    def _tag(self, stage: int, microbatch: int, direction: int) -> int:
        return (microbatch * self.n_stages + stage) * 2 + direction

    def train_step(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        ids, goals = idx.chunk(self.m), targets.chunk(self.m)
        shape = (ids[0].size(0), ids[0].size(1), self.width)             # (b, T, C) between stages
        saved, losses, sends = {}, [], []
        last = self.n_stages - 1
        for a in self.actions:
            stage, i = a.chunk * self.p + self.pp_rank, a.microbatch
            chunk = self.chunks[a.chunk]
            if a.kind == "F":
                if stage == 0:
                    x = ids[i]
                else:
                    x = torch.empty(shape)
                    dist.recv(x, self._peer(stage - 1), tag=self._tag(stage - 1, i, _FORWARD))
                    x.requires_grad_()
                out = chunk(x, goals[i])
                if stage == last:
                    losses.append(out.detach())
                    out = out / self.m
                else:
                    sends.append(dist.isend(out.detach(), self._peer(stage + 1), tag=self._tag(stage, i, _FORWARD)))
                saved[(stage, i)] = (x, out)
            else:
                x, out = saved.pop((stage, i))
                if stage == last:
                    out.backward()
                else:
                    grad = torch.empty(shape)
                    dist.recv(grad, self._peer(stage + 1), tag=self._tag(stage + 1, i, _BACKWARD))
                    out.backward(grad)
                if stage > 0:
                    sends.append(dist.isend(x.grad, self._peer(stage - 1), tag=self._tag(stage, i, _BACKWARD)))
        for w in sends:
            w.wait()
        self._sum_embedding_grads()
        loss = torch.stack(losses).mean() if losses and self.tp_rank == 0 else torch.zeros(())
        dist.all_reduce(loss)                       # the last stage's loss, on every rank
        return loss

    def _sum_embedding_grads(self) -> None:
        """Pipeline rank 0's first chunk is stage 0 (the embedding), rank p - 1's last chunk the
        last stage (the head): their tied weight's two gradients are summed."""
        if self.emb_group is None:
            return
        if self.pp_rank == 0:
            dist.all_reduce(self.chunks[0].wte.weight.grad, group=self.emb_group)
        if self.pp_rank == self.p - 1:
            dist.all_reduce(self.chunks[-1].head.grad, group=self.emb_group)
