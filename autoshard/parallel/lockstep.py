"""Every rank's graph in one process, node by node, in lockstep.

Ranks' graphs have identical structure, so position i is the same op on every rank. Ordinary nodes
run per rank; a collective module runs once across ranks through its `simulate(mods, rank_args)`,
the same autograd math as its distributed forward (parallel/comm.py's simulated twin), so its
backward is the exact conjugate too. The program simulator (compile/simulate.py) and the region
modules whose bodies hold collectives (regions/recompute.py, regions/experts_call.py) run on it.
"""
from __future__ import annotations

import torch.fx as fx

from autoshard.module_paths import fetch_attr

__all__ = ["run_lockstep"]


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
