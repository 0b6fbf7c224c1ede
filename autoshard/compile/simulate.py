"""All ranks in one process: run every rank's graph node by node, in lockstep.

Ranks' graphs have identical structure, so position i is the same op on every rank. Ordinary nodes
run per rank; a collective module runs once across ranks through its `simulate(mods, rank_args)`,
the same autograd math as its distributed forward, so its backward is the exact conjugate too.
One `.backward()` therefore reaches every rank's parameters, and what each rank computes is what
it would compute under torch.distributed.
"""
from __future__ import annotations

import torch
import torch.fx as fx
from torch import nn

from autoshard.compile.stage_layout import StageLayout
from autoshard.parallel.lockstep import run_lockstep

__all__ = ["join_replicated", "ProgramSimulator"]


def join_replicated(per_rank: list[object]) -> object:
    """One output from every rank's equal copy; gradients flow back into all of them."""
    lead = per_rank[0]
    if isinstance(lead, torch.Tensor) and lead.requires_grad:
        return _JoinN.apply(*per_rank)
    return lead


class _JoinN(torch.autograd.Function):
    @staticmethod
    def forward(ctx, *xs):
        ctx.n = len(xs)
        return xs[0].clone()

    @staticmethod
    def backward(ctx, grad):
        return tuple(grad for _ in range(ctx.n))


class ProgramSimulator:
    """Runs a program's ranks in lockstep (its tensor-parallel ranks; at ep > 1 those of every
    expert-parallel rank, each on its own inputs); with pipeline stages, stage after stage, each
    rank's stage outputs carried into its next stage (stage modules cached per rank graph)."""

    def __init__(self, stages: StageLayout):
        self.stages = stages
        self._modules: dict[int, list[fx.GraphModule]] = {}

    def run(self, ranks: list[nn.Module], calls: list[tuple[tuple, dict]],
            groups: list[list[int]] | None = None) -> tuple[list[list[object]], object]:
        """Every rank's flat outputs (rank i called with `calls[i]`: args and kwargs), and the output
        spec to unflatten them with; `groups` as run_lockstep's."""
        picked = [rank.graph_for(args, kwargs) for rank, (args, kwargs) in zip(ranks, calls)]
        flats, out_spec = [p[1] for p in picked], picked[0][2]
        n_stages = self.stages.pp * self.stages.virtual
        if n_stages == 1:
            return run_lockstep([p[0] for p in picked], flats, per_rank=True, groups=groups), out_spec
        carried: list[list[object]] = [[] for _ in picked]     # each rank's values between stages
        stage_gms = [self._stage_modules(rank, gm) for rank, (gm, _, _) in zip(ranks, picked)]
        for s in range(n_stages):
            carried = run_lockstep([gms[s] for gms in stage_gms], [list(f) + list(c) for f, c in zip(flats, carried)],
                                   per_rank=True, groups=groups)
        return carried, out_spec

    def _stage_modules(self, rank: nn.Module, gm: fx.GraphModule) -> list[fx.GraphModule]:
        if id(gm) not in self._modules:
            self._modules[id(gm)] = [fx.GraphModule(rank, sg.graph, class_name=f"Stage{sg.index}")
                                     for sg in self.stages.stage_graphs(gm)]
        return self._modules[id(gm)]
