"""The registry of modules the rewrite can ask a rank for: spec type -> what a rank lends its build.

The rewrite (passes/rewrite/rank_rewrite.py) emits a spec per module a rank graph calls (besides f
and g, which every rank has); `build_module` turns it into the module. Adding a collective is one
file here in parallel/ (its autograd function, its `Collective` module with `run`, its frozen spec
with `build`) and one row below.
"""
from __future__ import annotations

from typing import Protocol

from torch import nn

from autoshard.parallel.comm import CommHandle
from autoshard.parallel.rng import RandomOpSpec, RNGTracker
from autoshard.parallel.sequence_parallel import SequenceSpec
from autoshard.parallel.tensor_parallel import SyncSpec
from autoshard.parallel.vocab_parallel import CrossEntropySpec, GatherSpec

__all__ = ["RankResources", "ModuleSpec", "COLLECTIVES", "build_module"]


class RankResources(Protocol):
    """What a rank lends the modules it builds."""

    handle: CommHandle        # its communicator
    rng: RNGTracker           # its generator states, per RNG region


ModuleSpec = SyncSpec | SequenceSpec | GatherSpec | CrossEntropySpec | RandomOpSpec

# spec type -> the rank resource its `build` takes
COLLECTIVES: dict[type, str] = {
    SyncSpec: "handle",            # sync_<param>: rows of a parameter held by several ranks (GQA)
    SequenceSpec: "handle",        # sequence parallelism's reduce-scatter / all-gather
    GatherSpec: "handle",          # gather_<node>: sharded outputs the model returns
    CrossEntropySpec: "handle",    # vocab_cross_entropy_<node>: the loss on vocabulary shards
    RandomOpSpec: "rng",           # <region>_rng_<node>: a random op under its region's generator
}


def build_module(spec: ModuleSpec, rank: RankResources) -> nn.Module:
    try:
        resource = COLLECTIVES[type(spec)]
    except KeyError:
        raise TypeError(f"no module is registered for {type(spec).__name__} ({spec.module}); add a row to "
                        f"autoshard/parallel/registry.py's COLLECTIVES") from None
    return spec.build(getattr(rank, resource))
