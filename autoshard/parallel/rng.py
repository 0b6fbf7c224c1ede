"""Dropout randomness per region, after Megatron's RNG tracker.

Inside a tensor-parallel region each rank holds different features, so its dropout mask must differ
from the other ranks'; outside, every rank holds the same activations and must drop the same
elements, or the replicas drift apart. Each rank keeps two generator states, swapped in around the
random op: `replicated` (seeded alike on every rank) and `tensor_parallel` (seed + 2718 + rank, the
offset Megatron uses). Both come from one seed, so a run is reproducible. Context-parallel ranks
hold different tokens, so every region's stream is shifted by CP_SEED_OFFSET x cp_rank (the ranks of
one context-parallel rank still agree outside tensor-parallel regions).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn

from autoshard.parallel.random_ops import RandomOp

__all__ = ["RNGTracker", "RegionRandomOp", "RandomOpSpec", "TP_SEED_OFFSET", "CP_SEED_OFFSET"]

TP_SEED_OFFSET = 2718
CP_SEED_OFFSET = 1_000_003      # far from seed + TP_SEED_OFFSET + tp rank


class RNGTracker:
    """Generator states of one rank: CPU state, and the state of each CUDA device used."""

    def __init__(self, rank: int, seed: int = 0, cp_rank: int = 0):
        self.rank, self.cp_rank = rank, cp_rank
        self.manual_seed(seed)

    def manual_seed(self, seed: int) -> None:
        seed += CP_SEED_OFFSET * self.cp_rank
        self.seeds = {"replicated": seed, "tensor_parallel": seed + TP_SEED_OFFSET + self.rank}
        self.states: dict[tuple[str, str], torch.Tensor] = {}

    def _state(self, region: str, device: torch.device) -> torch.Tensor:
        key = (region, str(device))
        if key not in self.states:
            gen = torch.Generator(device=device).manual_seed(self.seeds[region])
            self.states[key] = gen.get_state()
        return self.states[key]

    @contextlib.contextmanager
    def fork(self, region: str, device: torch.device | str = "cpu"):
        """Run the block with `region`'s generator state on `device`; the default state is restored."""
        device = torch.device(device)
        if device.type == "meta":           # shapes only (planning/graph_memory.py): no generator draws
            device = torch.device("cpu")
        cuda = device.type == "cuda"
        saved = torch.cuda.get_rng_state(device) if cuda else torch.get_rng_state()
        (torch.cuda.set_rng_state if cuda else torch.set_rng_state)(
            *((self._state(region, device), device) if cuda else (self._state(region, device),)))
        try:
            yield
        finally:
            self.states[(region, str(device))] = torch.cuda.get_rng_state(device) if cuda else torch.get_rng_state()
            (torch.cuda.set_rng_state if cuda else torch.set_rng_state)(*((saved, device) if cuda else (saved,)))


@dataclass(frozen=True)
class RandomOpSpec:
    """The rewrite's request for a `RegionRandomOp` named `module`: `op` run with `region`'s generator
    ("tensor_parallel" inside a sharded region, else "replicated"); `knobs` is its RANDOM_OPS row."""

    module: str
    op: object
    region: str
    knobs: RandomOp

    def build(self, tracker: "RNGTracker") -> "RegionRandomOp":
        return RegionRandomOp(tracker, self.op, self.region, self.knobs)


class RegionRandomOp(nn.Module):
    """Runs a random op (dropout, attention with dropout, the fused bias + dropout + residual) with
    its region's generator state.

    The op only drops when this module is in training mode: `rank.eval()` turns dropout off as it
    does for the original model. An op that takes a seed (`knobs.seed`) gets one drawn from the
    region's CPU generator state: no device sync, and the region's rule holds (one seed on every
    rank of a replicated region, a rank's own inside a tensor-parallel one)."""

    def __init__(self, tracker: RNGTracker, op, region: str, knobs: RandomOp):
        super().__init__()
        self.tracker, self.op, self.region, self.knobs = tracker, op, region, knobs

    def forward(self, *args, **kwargs):
        if not self.training:
            pos, key, value = self.knobs.off()
            if len(args) > pos:
                args = (*args[:pos], value, *args[pos + 1:])
            elif key in kwargs:
                kwargs = {**kwargs, key: value}
        if self.knobs.seed is not None:               # eval mode: p is 0 and no seed is drawn
            seat, seed = self.knobs.seed, 0
            if self.training:
                with self.tracker.fork(self.region, "cpu"):
                    seed = int(torch.randint(0, 2**31 - 1, ()))
            return self.op(*args[:seat], seed, *args[seat + 1:], **kwargs)
        device = args[0].device if isinstance(args[0], torch.Tensor) else torch.device("cpu")
        with self.tracker.fork(self.region, device):
            return self.op(*args, **kwargs)

    def extra_repr(self) -> str:
        return f"{self.op}, region={self.region}"
