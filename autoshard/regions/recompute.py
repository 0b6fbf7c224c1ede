"""The module a recomputed region's call runs (passes/recompute.py outlines the regions).

`Recompute(body, rng)` runs `body` (the region's graph) under torch.utils.checkpoint (non-reentrant):
the forward keeps only the region's inputs, and backward runs the body again to get what it needs.
Randomness is replayed exactly: each rank's dropout generators live in its RNG tracker
(parallel/rng.py), whose states the forward snapshots and the recomputation swaps in (and back out,
so forwards of later microbatches that ran in between keep their own draws); torch's default
generator is replayed by checkpoint's preserve_rng_state. Collectives in the body (f, g, sequence
parallelism's gathers) run again in the recomputation, in the same order on every rank.

In simulation all tensor-parallel ranks are one checkpoint: `simulate(mods, rank_args)` runs every
rank's body in lockstep inside it, so the recomputation's collectives meet all ranks' values again.
"""
from __future__ import annotations

import contextlib

import torch
import torch.fx as fx
from torch import nn
from torch.utils.checkpoint import checkpoint

from autoshard.parallel.lockstep import run_lockstep
from autoshard.parallel.rng import RNGTracker

__all__ = ["Recompute"]


def _replaying(trackers: list[RNGTracker]):
    """checkpoint's context_fn: (forward context, recomputation context) for these trackers."""
    snapshot: list[dict] = []

    @contextlib.contextmanager
    def forward():
        snapshot[:] = [dict(t.states) for t in trackers]     # states are replaced, never mutated
        yield

    @contextlib.contextmanager
    def recompute():
        now = [t.states for t in trackers]
        for t, s in zip(trackers, snapshot):
            t.states = dict(s)
        try:
            yield
        finally:
            for t, s in zip(trackers, now):
                t.states = s

    return forward(), recompute()


class Recompute(nn.Module):
    """A recomputed region of one rank's graph: `body` run under activation checkpointing."""

    def __init__(self, body: fx.GraphModule, rng: RNGTracker, layer: str, mode: str):
        super().__init__()
        self.body = body
        self.rng = rng            # plain attribute: the rank's tracker, shared with its random ops
        self.layer, self.mode = layer, mode

    def forward(self, *args):
        if not torch.is_grad_enabled():
            return self.body(*args)
        return checkpoint(self.body, *args, use_reentrant=False, preserve_rng_state=True,
                          context_fn=lambda: _replaying([self.rng]))

    spans_groups = True     # simulated: its body's collectives run per group (compile/simulate.py)

    @staticmethod
    def simulate(mods: list["Recompute"], rank_args: list[list[object]],
                 groups: list[list[int]] | None = None) -> list[object]:
        """Every rank's region at once, one checkpoint around the lockstep run."""
        n = len(rank_args[0])

        def run(*flat):
            per_rank = [list(flat[r * n:(r + 1) * n]) for r in range(len(mods))]
            return tuple(run_lockstep([m.body for m in mods], per_rank, per_rank=True, groups=groups))

        flat = [a for args in rank_args for a in args]
        if not torch.is_grad_enabled():
            return list(run(*flat))
        return list(checkpoint(run, *flat, use_reentrant=False, preserve_rng_state=True,
                               context_fn=lambda: _replaying([m.rng for m in mods])))

    def extra_repr(self) -> str:
        nodes = sum(n.op not in ("placeholder", "output") for n in self.body.graph.nodes)
        kept = sum(n.op == "placeholder" for n in self.body.graph.nodes)
        return f"{self.mode} recompute of {self.layer}: {nodes} nodes run again in backward, {kept} inputs kept"
