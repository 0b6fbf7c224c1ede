"""`prog.simulate()` at ep > 1 or cp > 1: the ranks of the data-parallel axis that meet, in one process.

Expert parallelism and context parallelism both live inside the data-parallel axis (runtime/mesh.py):
data rank d is context-parallel rank d % cp of batch replica d // cp, and expert-parallel rank d % ep
of expert group d // ep. The simulator holds D = lcm(ep, cp) such data ranks, the fewest in which
every group is whole, each a replica of the tensor-parallel rank programs (replica d's rank t is
`prog.rank(t, ep_rank=d % ep, cp_rank=d % cp)`), and runs all D x tp of them in lockstep: the batch
is cut in D / cp slices, replica d reading slice d // cp whole and cutting its own tokens. The
collectives meet across the replicas: the context-parallel ones (`ContextCollective.simulate`) in
runs of cp replicas, the experts calls (`ExpertsCall.simulate`) in runs of ep replicas, so what is
checked is what a real run exchanges.

Outputs are joined over each replica's tp ranks, then over the replicas:
- an output holding the rank's tokens (the context pass's `ContextCut.local_outputs`) is concatenated
  over the slice's cp replicas along its token dim and put back in position order;
- the mean cross-entropy is every replica's weighted by its share of the counted tokens, as
  MeshRuntime weights data ranks (a replica counting none adds nothing: its mean is 0/0);
- a batched tensor is concatenated over the slices along the batch; anything else is the same on
  every replica (a scalar other than the loss: the slices' mean).
Gradients are reassembled per replica (tp shards) and summed over the replicas, each replica's being
its tokens' share, as data parallelism's; an expert's over the replicas holding the same experts,
then the ep ranks' experts concatenated along the experts dim. Parameters are read from the first
replica (the experts from each ep rank's first).
"""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.utils._pytree as pytree

from autoshard.compile.reassemble import assemble
from autoshard.compile.simulate import ProgramSimulator, join_replicated
from autoshard.errors import ShardingError
from autoshard.parallel.context_parallel import rank_order
from autoshard.runtime.batching import split_batch
from autoshard.runtime.loss_tokens import loss_tokens_of

__all__ = ["DataReplicas"]


class DataReplicas:
    """lcm(ep, cp) data ranks of a program, each a replica of its tensor-parallel rank programs."""

    def __init__(self, prog):
        self.prog, self.ep, self.cp = prog, prog.dims.ep, prog.cp
        self.size = math.lcm(self.ep, self.cp)
        self.slices = self.size // self.cp
        self.replicas = [[prog.rank(t, ep_rank=d % self.ep if self.ep > 1 else None,
                                    cp_rank=d % self.cp if self.cp > 1 else None) for t in range(prog.tp)]
                         for d in range(self.size)]

    def ranks(self) -> list[torch.nn.Module]:
        """Every replica's ranks, data rank major."""
        return [rank for ranks in self.replicas for rank in ranks]

    def run(self, simulator: ProgramSimulator, args: tuple, kwargs: dict) -> tuple[list[list[object]], object]:
        """Every rank's flat outputs on its replica's batch slice, and the output spec."""
        if self.slices == 1:
            calls = [(args, kwargs)] * self.size
        else:
            named = self.replicas[0][0].bind_inputs(args, kwargs)
            try:
                parts = split_batch(named, self.slices, "lcm(ep, cp) / cp")
            except ShardingError as err:
                raise ShardingError(f"prog.simulate() at ep={self.ep}, cp={self.cp} gives each of {self.slices} "
                                    f"batch replicas its slice of the batch: {err}") from None
            calls = [((), parts[d // self.cp]) for d in range(self.size)]
        tp = self.prog.tp
        self._calls = calls
        return simulator.run(self.ranks(), [c for c in calls for _ in range(tp)],
                             [list(range(d * tp, (d + 1) * tp)) for d in range(self.size)])

    def join(self, outs: list[list[object]], spec) -> object:
        """One output from every rank's (see the module doc)."""
        tp, cp = self.prog.tp, self.cp
        per_replica = [[join_replicated(list(leaf)) for leaf in zip(*outs[d * tp:(d + 1) * tp])]
                       for d in range(self.size)]
        graphs = [ranks[0].graph_for(*call) for ranks, call in zip(self.replicas, self._calls)]
        cut = graphs[0][0].meta.get("context")
        counter = loss_tokens_of(graphs[0][0])
        joined = []
        for i, leaf in enumerate(zip(*per_replica)):
            if (cut is not None and i == cut.loss_output) or (counter is not None and i == counter.output):
                joined.append(sum(torch.where(w > 0, v * w.to(v.dtype), 0.0)
                                  for v, w in zip(leaf, self._token_weights(graphs))))
                continue
            per_slice = [leaf[g * cp:(g + 1) * cp] for g in range(self.slices)]
            if cut is not None and i in cut.local_outputs:
                per_slice = [_in_position_order(parts, cut.local_outputs[i], cp) for parts in per_slice]
            else:
                per_slice = [parts[0] for parts in per_slice]
            if self.slices == 1 or not isinstance(per_slice[0], torch.Tensor):
                joined.append(per_slice[0])
            elif per_slice[0].dim() > 0:
                joined.append(torch.cat(per_slice, 0))
            else:
                joined.append(torch.stack(per_slice).mean(0))
        return pytree.tree_unflatten(joined, spec)

    def _token_weights(self, graphs: list) -> list[torch.Tensor]:
        counts = []
        for gm, flat, _ in graphs:
            counter = loss_tokens_of(gm)
            if counter is None:
                raise ShardingError(f"ep={self.ep}, cp={self.cp}: the model's loss is a mean cross-entropy whose "
                                    "counted tokens cannot be read from the graph's inputs; the data ranks' means "
                                    "cannot be weighted")
            counts.append(counter.count(*flat).double())
        total = sum(counts)
        return [c / total for c in counts]

    def assemble(self, read: Callable[[torch.nn.Parameter], torch.Tensor | None], summed: bool):
        """Full tensors by name (see the module doc): gradients with `summed`, else parameters."""
        prog = self.prog
        experts = prog.expert_params if self.ep > 1 else set()
        shapes = {n: torch.Size([s[0] // self.ep, *s[1:]]) if n in experts else s for n, s in prog.param_shapes.items()}
        parts = [assemble(ranks, prog.sharding, shapes, read) for ranks in self.replicas]
        out = {}
        for name in shapes:
            if name in experts:     # ep rank e's experts: on replicas e, e + ep, ...
                held = [_total([p[name] for p in parts[e::self.ep]], summed) for e in range(self.ep)]
                out[name] = None if any(v is None for v in held) else torch.cat(held, 0)
            else:
                out[name] = _total([p[name] for p in parts], summed)
        return out


def _total(values: list[torch.Tensor | None], summed: bool) -> torch.Tensor | None:
    """The replicas' sum (gradients) or the first replica's value (parameters, equal on every one)."""
    if not summed:
        return values[0]
    present = [v for v in values if v is not None]
    return sum(present[1:], present[0].clone()) if present else None


def _in_position_order(parts: tuple[torch.Tensor, ...], dim: int, cp: int) -> torch.Tensor:
    """The cp ranks' tokens of one slice, concatenated in rank order, put back in position order."""
    full = torch.cat(parts, dim)
    return full.index_select(dim, rank_order(full.shape[dim], cp, full.device))
