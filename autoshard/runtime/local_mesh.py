"""Every rank of a program's mesh in one process: the runtime itself on a local world.

    mesh = prog.local_mesh()                      # one MeshRuntime per rank, world/local.py's threads
    opts = mesh.each(lambda rt: DistributedOptimizer(rt, torch.optim.AdamW, lr=1e-3))
    for batch in batches:
        losses = mesh.train_step(**batch)         # every rank's loss (equal on every rank)
        mesh.each(lambda rt, opt: opt.step(), opts)

Each rank runs exactly what a torchrun process runs (`prog.distributed(mesh=True)` and its
`train_step`: the schedule's actions, the pipeline's transfers, gradient buckets, loss-token
counts, the distributed optimizer's gathers, expert all-to-alls, the context-parallel ring), and
its collectives meet the other ranks' in the local world instead of on gloo or NCCL. The ranks
share the program's compiled graphs, each with parameters of its own (compile/cut_ranks.py).
"""
from __future__ import annotations

from typing import Any, Callable

from autoshard.world import LocalWorld

__all__ = ["LocalMesh"]


class LocalMesh:
    """A program's `world_size` ranks, each a MeshRuntime, in one process (module doc)."""

    def __init__(self, prog: Any):
        self.world = LocalWorld(prog.world_size)
        self.runtimes = self.world.run(lambda r: prog.distributed(mesh=True))

    def each(self, fn: Callable[..., Any], *per_rank: list) -> list:
        """`fn(runtime, *(x[r] for x in per_rank))` on every rank, each in its rank's thread (so that
        its collectives meet); the results in rank order."""
        return self.world.run(lambda r: fn(self.runtimes[r], *(x[r] for x in per_rank)))

    def train_step(self, *args, **kwargs) -> list:
        """`runtime.train_step(*args, **kwargs)` on every rank; every rank's loss."""
        return self.each(lambda rt: rt.train_step(*args, **kwargs))
