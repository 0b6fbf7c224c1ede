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
from autoshard.module_paths import fetch_attr

__all__ = ["run_lockstep", "join_replicated", "ProgramSimulator"]


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


def run_lockstep(gms: list[fx.GraphModule], flat_inputs: list, *, per_rank: bool = False,
                 groups: list[list[int]] | None = None) -> list[object]:
    """Run rank graphs `gms` on the same flat inputs (or, with per_rank, `flat_inputs[r]` for
    rank r); returns each rank's flat outputs. `groups`: the tensor-parallel groups among the ranks
    (default: all of them one group); a collective runs once per group, unless its module spans
    groups itself (`spans_groups`: expert parallelism's calls)."""
    node_lists = [list(gm.graph.nodes) for gm in gms]
    if len({len(n) for n in node_lists}) != 1:
        raise RuntimeError("rank graphs differ in length; they cannot run in lockstep")
    envs: list[dict[fx.Node, object]] = [{} for _ in gms]
    inputs = [iter(flat_inputs[r] if per_rank else flat_inputs) for r in range(len(gms))]
    for column in zip(*node_lists):
        lead = column[0]
        if any(n.op != lead.op or n.target != lead.target for n in column):
            raise RuntimeError(f"rank graphs diverge at node {lead.name}")
        if lead.op == "placeholder":
            for env, n, it in zip(envs, column, inputs):
                env[n] = next(it)
            continue
        args = [fx.map_arg((n.args, n.kwargs), lambda a, env=env: env[a]) for n, env in zip(column, envs)]
        if lead.op == "output":
            return [a[0][0] for a in args]
        if lead.op == "call_module":
            mods = [gm.get_submodule(n.target) for gm, n in zip(gms, column)]
            simulate = getattr(type(mods[0]), "simulate", None)
            if simulate is not None:      # a collective: one call across the ranks of each group
                outs = _per_group(simulate, mods, [a for a, _ in args], groups)
            else:
                outs = [m(*a, **kw) for m, (a, kw) in zip(mods, args)]
            for env, n, o in zip(envs, column, outs):
                env[n] = o
            continue
        for gm, env, n, (a, kw) in zip(gms, envs, column, args):
            env[n] = fetch_attr(gm, n.target) if n.op == "get_attr" else n.target(*a, **kw)
    raise RuntimeError("graph has no output node")


def _per_group(simulate, mods: list, rank_args: list, groups: list[list[int]] | None) -> list[object]:
    if getattr(type(mods[0]), "spans_groups", False):      # it runs every rank itself, given the groups
        return simulate(mods, rank_args, groups=groups)
    if groups is None:
        return simulate(mods, rank_args)
    outs: list[object] = [None] * len(mods)
    for group in groups:
        for i, o in zip(group, simulate([mods[i] for i in group], [rank_args[i] for i in group])):
            outs[i] = o
    return outs


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
