"""`prog.simulate()` at cp > 1: the context-parallel ranks of one group, in one process.

The simulator holds cp replicas of the tensor-parallel rank programs (replica c's rank t is
`prog.rank(t, cp_rank=c)`: the same parameter shards, the graph of context-parallel rank c) and
runs all cp x tp of them in lockstep on the same whole batch; each cuts its own tokens. The key and
value gathers meet across the replicas (`GatherFromContextParallelRegion.simulate`: the same
tensor-parallel rank of every replica), so what is checked is what a real run exchanges.

Outputs are joined over each replica's tp ranks, then over the replicas: an output holding the
rank's tokens (the pass's `ContextCut.local_outputs`) is concatenated along its token dim and put
back in position order; the mean cross-entropy is each replica's weighted by its share of the
counted tokens (as MeshRuntime weights data-parallel ranks); anything else is the same on every
replica. Gradients are summed over the replicas (each replica's is its tokens' share, as data
parallelism's), parameters read from the first.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.utils._pytree as pytree

from autoshard.compile.reassemble import assemble
from autoshard.compile.simulate import ProgramSimulator, join_replicated
from autoshard.errors import ShardingError
from autoshard.parallel.context_parallel import rank_order
from autoshard.runtime.loss_tokens import loss_tokens_of

__all__ = ["ContextReplicas"]


class ContextReplicas:
    """cp replicas of a program's tensor-parallel ranks, replica c cutting context-parallel rank c's tokens."""

    def __init__(self, prog):
        self.prog, self.cp = prog, prog.cp
        self.replicas = [[prog.rank(t, cp_rank=c) for t in range(prog.tp)] for c in range(self.cp)]

    def ranks(self) -> list[torch.nn.Module]:
        """Every replica's ranks, context-parallel rank major."""
        return [rank for ranks in self.replicas for rank in ranks]

    def run(self, simulator: ProgramSimulator, args: tuple, kwargs: dict) -> tuple[list[list[object]], object]:
        tp = self.prog.tp
        groups = [list(range(c * tp, (c + 1) * tp)) for c in range(self.cp)]
        self._call = (args, kwargs)
        return simulator.run(self.ranks(), [(args, kwargs)] * (self.cp * tp), groups)

    def join(self, outs: list[list[object]], spec) -> object:
        tp = self.prog.tp
        per_replica = [[join_replicated(list(leaf)) for leaf in zip(*outs[c * tp:(c + 1) * tp])]
                       for c in range(self.cp)]
        graphs = [ranks[0].graph_for(*self._call) for ranks in self.replicas]
        cut = graphs[0][0].meta.get("context")
        joined = []
        for i, leaf in enumerate(zip(*per_replica)):
            if cut is not None and i in cut.local_outputs:
                d = cut.local_outputs[i]
                full = torch.cat(leaf, d)           # (.., seq, ..) in rank order
                joined.append(full.index_select(d, rank_order(full.shape[d], self.cp, full.device)))
            elif cut is not None and i == cut.loss_output:
                # a replica that counts no token has a mean of 0/0: it adds nothing (and no gradient)
                joined.append(sum(torch.where(w > 0, v * w.to(v.dtype), 0.0)
                                  for v, w in zip(leaf, self._token_weights(graphs))))
            else:
                joined.append(join_replicated(list(leaf)))
        return pytree.tree_unflatten(joined, spec)

    def _token_weights(self, graphs: list) -> list[torch.Tensor]:
        counts = []
        for gm, flat, _ in graphs:
            counter = loss_tokens_of(gm)
            if counter is None:
                raise ShardingError("cp > 1: the model's loss is a mean cross-entropy whose counted tokens cannot be "
                                    "read from the graph's inputs; ranks' means cannot be weighted")
            counts.append(counter.count(*flat).double())
        total = sum(counts)
        return [c / total for c in counts]

    def assemble(self, read: Callable[[torch.nn.Parameter], torch.Tensor | None], summed: bool):
        """Full tensors by name: summed over the replicas (`summed`: gradients) or the first replica's."""
        prog = self.prog
        parts = [assemble(ranks, prog.sharding, prog.param_shapes, read) for ranks in self.replicas]
        if not summed:
            return parts[0]
        out = {}
        for name in parts[0]:
            present = [p[name] for p in parts if p[name] is not None]
            out[name] = sum(present[1:], present[0].clone()) if present else None
        return out
