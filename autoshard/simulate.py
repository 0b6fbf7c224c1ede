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

from .capture import fetch_attr

__all__ = ["run_lockstep", "join_replicated"]


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


def run_lockstep(gms: list[fx.GraphModule], flat_inputs: list, *, per_rank: bool = False) -> list[object]:
    """Run rank graphs `gms` on the same flat inputs (or, with per_rank, `flat_inputs[r]` for
    rank r); returns each rank's flat outputs."""
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
            if simulate is not None:      # a collective: one call across all ranks
                outs = simulate(mods, [a for a, _ in args])
            else:
                outs = [m(*a, **kw) for m, (a, kw) in zip(mods, args)]
            for env, n, o in zip(envs, column, outs):
                env[n] = o
            continue
        for gm, env, n, (a, kw) in zip(gms, envs, column, args):
            env[n] = fetch_attr(gm, n.target) if n.op == "get_attr" else n.target(*a, **kw)
    raise RuntimeError("graph has no output node")
