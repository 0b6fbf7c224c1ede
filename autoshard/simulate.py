"""All ranks in one process: run every rank's graph node by node, in lockstep.

Ranks' graphs have identical structure, so position i is the same op on every rank. Ordinary nodes
run per rank; the collectives f, g and sync_* run once across ranks, as autograd functions whose
backward is the collective's exact conjugate. One `.backward()` therefore reaches every rank's
parameters, and what each rank computes is what it would compute under torch.distributed.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from .capture import fetch_attr
from .collectives import (CopyToTensorParallelRegion, ReduceFromTensorParallelRegion, SyncReplicatedShard,
                          scatter_into_full, take_from_full)

from .sequence_parallel import (GatherFromSequenceParallelRegion, ReduceScatterToSequenceParallelRegion,
                                seq_all_gather, seq_reduce_scatter, sim_seq_ops)
from .vocab_parallel import (GatherFromTensorParallelRegion, VocabParallelCrossEntropy, gather_shards, sim_reducer,
                             vocab_cross_entropy)

__all__ = ["run_lockstep", "join_replicated"]


class _SimF(torch.autograd.Function):
    """f over all ranks: identity forward; backward every rank gets the sum of all ranks' grads."""

    @staticmethod
    def forward(ctx, *xs):
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx, *grads):
        total = sum(grads[1:], grads[0].clone())
        return tuple(total.clone() for _ in grads)


class _SimG(torch.autograd.Function):
    """g over all ranks: forward every rank gets the sum; backward identity."""

    @staticmethod
    def forward(ctx, *xs):
        total = sum(xs[1:], xs[0].clone())
        return tuple(total.clone() for _ in xs)

    @staticmethod
    def backward(ctx, *grads):
        return grads


class _SimSync(torch.autograd.Function):
    @staticmethod
    def forward(ctx, specs, *ws):
        ctx.specs = specs
        return tuple(w.view_as(w) for w in ws)

    @staticmethod
    def backward(ctx, *grads):
        fulls = [scatter_into_full(g, m.dim, m.size, m.ranges) for g, m in zip(grads, ctx.specs)]
        total = sum(fulls[1:], fulls[0])
        return (None, *(take_from_full(total, m.dim, m.ranges) for m in ctx.specs))


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


def run_lockstep(gms: list[fx.GraphModule], flat_inputs: list[object]) -> list[object]:
    """Run rank graphs `gms` on the same flat inputs; returns each rank's flat outputs."""
    node_lists = [list(gm.graph.nodes) for gm in gms]
    if len({len(n) for n in node_lists}) != 1:
        raise RuntimeError("rank graphs differ in length; they cannot run in lockstep")
    envs: list[dict[fx.Node, object]] = [{} for _ in gms]
    inputs = iter(flat_inputs)
    for column in zip(*node_lists):
        lead = column[0]
        if any(n.op != lead.op or n.target != lead.target for n in column):
            raise RuntimeError(f"rank graphs diverge at node {lead.name}")
        if lead.op == "placeholder":
            value = next(inputs)
            for env, n in zip(envs, column):
                env[n] = value
            continue
        args = [fx.map_arg((n.args, n.kwargs), lambda a, env=env: env[a]) for n, env in zip(column, envs)]
        if lead.op == "output":
            return [a[0][0] for a in args]
        if lead.op == "call_module":
            mods = [gm.get_submodule(n.target) for gm, n in zip(gms, column)]
            if isinstance(mods[0], VocabParallelCrossEntropy):
                outs = vocab_cross_entropy(sim_reducer(), [m.shard for m in mods], args[0][0][1],
                                           [a[0][0] for a in args], ignore_index=mods[0].ignore_index,
                                           reduction=mods[0].reduction)
                for env, n, o in zip(envs, column, outs):
                    env[n] = o
                continue
            if isinstance(mods[0], (ReduceScatterToSequenceParallelRegion, GatherFromSequenceParallelRegion)):
                xs = [a[0][0] for a in args]
                if isinstance(mods[0], ReduceScatterToSequenceParallelRegion):
                    outs = seq_reduce_scatter(sim_seq_ops(), mods[0].dim, mods[0].outer, xs)
                else:
                    outs = seq_all_gather(sim_seq_ops(), mods[0].dim, mods[0].outer, xs, mods[0].reduce_grads)
                for env, n, o in zip(envs, column, outs):
                    env[n] = o
                continue
            if isinstance(mods[0], GatherFromTensorParallelRegion):
                m0 = mods[0]
                outs = gather_shards(sim_reducer(), m0.dim, m0.size, m0.valid, [m.ranges for m in mods],
                                     [a[0][0] for a in args])
                for env, n, o in zip(envs, column, outs):
                    env[n] = o
                continue
            if isinstance(mods[0], (CopyToTensorParallelRegion, ReduceFromTensorParallelRegion, SyncReplicatedShard)):
                xs = [a[0][0] for a in args]
                if isinstance(mods[0], CopyToTensorParallelRegion):
                    outs = _SimF.apply(*xs)
                elif isinstance(mods[0], ReduceFromTensorParallelRegion):
                    outs = _SimG.apply(*xs)
                else:
                    outs = _SimSync.apply(mods, *xs)
                for env, n, o in zip(envs, column, outs):
                    env[n] = o
                continue
            for env, n, m, (a, kw) in zip(envs, column, mods, args):
                env[n] = m(*a, **kw)
            continue
        for gm, env, n, (a, kw) in zip(gms, envs, column, args):
            env[n] = fetch_attr(gm, n.target) if n.op == "get_attr" else n.target(*a, **kw)
    raise RuntimeError("graph has no output node")
