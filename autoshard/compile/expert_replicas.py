"""`prog.simulate()` at ep > 1: the expert-parallel ranks of one group, in one process.

Expert parallelism lives inside data parallelism, so each of the ep ranks trains on its own slice of
the batch. The simulator therefore holds ep replicas of the tensor-parallel rank programs (replica
e's rank t is `prog.rank(t, ep_rank=e)`: cut to its experts when it is built, its experts calls bound
to a simulated group) and runs all ep x tp of them in lockstep, replica e on batch slice e. The experts
calls meet in `ExpertsCall.simulate`, whose all-to-all is the simulator's permutation of the ranks'
lists (parallel/comm.py), so what is checked is the dispatch a real run does.

Outputs are joined over each replica's tp ranks, then over the replicas: a batched tensor is
concatenated along the batch; a scalar is the model's per-token mean where the graph's loss is a mean
cross-entropy (each replica's weighted by its count of tokens, as MeshRuntime does), else the mean
of the replicas' values. Gradients and parameters are reassembled per replica (tp shards), then
expert parameters are concatenated over the replicas along the experts dim and every other
parameter's gradient is summed over them (each replica's is its slice's share, as data parallelism's).
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.utils._pytree as pytree

from autoshard.compile.reassemble import assemble
from autoshard.compile.simulate import ProgramSimulator, join_replicated
from autoshard.errors import ShardingError
from autoshard.runtime.batching import split_batch
from autoshard.runtime.loss_tokens import loss_tokens_of

__all__ = ["ExpertReplicas"]


class ExpertReplicas:
    """ep replicas of a program's tensor-parallel ranks, each holding its expert-parallel rank's experts."""

    def __init__(self, prog):
        self.prog, self.ep = prog, prog.dims.ep
        self.replicas = [[prog.rank(t, ep_rank=e) for t in range(prog.tp)] for e in range(self.ep)]

    def ranks(self) -> list[torch.nn.Module]:
        """Every replica's ranks, expert-parallel rank major."""
        return [rank for ranks in self.replicas for rank in ranks]

    def run(self, simulator: ProgramSimulator, args: tuple, kwargs: dict) -> tuple[list[list[object]], object]:
        """Every rank's flat outputs on its replica's batch slice, and the output spec."""
        named = self.replicas[0][0].bind_inputs(args, kwargs)
        try:
            slices = split_batch(named, self.ep, "ep")
        except ShardingError as err:
            raise ShardingError(f"prog.simulate() at ep={self.ep} gives each expert-parallel rank its slice of the "
                                f"batch: {err}") from None
        tp = self.prog.tp
        calls = [((), slices[e]) for e in range(self.ep) for _ in range(tp)]
        outs, spec = simulator.run(self.ranks(), calls, [list(range(e * tp, (e + 1) * tp)) for e in range(self.ep)])
        self._slices = slices
        return outs, spec

    def join(self, outs: list[list[object]], spec) -> object:
        """One output from every rank's (see the module doc)."""
        tp = self.prog.tp
        per_replica = [[join_replicated(list(leaf)) for leaf in zip(*outs[e * tp:(e + 1) * tp])]
                       for e in range(self.ep)]
        weights = self._token_weights()
        joined = []
        for i, leaf in enumerate(zip(*per_replica)):
            if not isinstance(leaf[0], torch.Tensor):
                joined.append(leaf[0])
            elif leaf[0].dim() > 0:
                joined.append(torch.cat(leaf, 0))
            elif weights is not None and i == weights[0]:
                joined.append(sum(v * w for v, w in zip(leaf, weights[1])))
            else:
                joined.append(torch.stack(list(leaf)).mean(0))
        return pytree.tree_unflatten(joined, spec)

    def _token_weights(self) -> tuple[int, list[torch.Tensor]] | None:
        rank = self.replicas[0][0]
        gm, _, _ = rank.graph_for((), self._slices[0])
        counter = loss_tokens_of(gm)
        if counter is None:
            return None
        counts = [counter.count(*rank.graph_for((), s)[1]).double() for s in self._slices]
        total = sum(counts)
        return counter.output, [c / total for c in counts]

    def assemble(self, read: Callable[[torch.nn.Parameter], torch.Tensor | None], summed: bool):
        """Full tensors by name: experts concatenated over the replicas; the rest summed over them
        (`summed`: gradients) or taken from the first (parameters, equal on every replica)."""
        prog = self.prog
        experts = prog.expert_params
        shapes = {n: torch.Size([s[0] // self.ep, *s[1:]]) if n in experts else s for n, s in prog.param_shapes.items()}
        parts = [assemble(ranks, prog.sharding, shapes, read) for ranks in self.replicas]
        out = {}
        for name in shapes:
            values = [p[name] for p in parts]
            if name in experts:
                out[name] = None if any(v is None for v in values) else torch.cat(values, 0)
            elif summed:
                present = [v for v in values if v is not None]
                out[name] = sum(present[1:], present[0].clone()) if present else None
            else:
                out[name] = values[0]
        return out
