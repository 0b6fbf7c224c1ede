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
from autoshard.parallel.context_parallel import ContextGatherSpec
from autoshard.parallel.fp8_linear import Fp8LinearSpec
from autoshard.parallel.ring_attention import RingAttentionSpec
from autoshard.parallel.rng import RandomOpSpec, RNGTracker
from autoshard.parallel.sequence_parallel import SequenceSpec
from autoshard.parallel.tensor_parallel import SyncSpec
from autoshard.parallel.vocab_parallel import CrossEntropySpec, GatherSpec

__all__ = ["RankResources", "ModuleSpec", "COLLECTIVES", "build_module", "row_for"]


class RankResources(Protocol):
    """What a rank lends the modules it builds."""

    handle: CommHandle        # its communicator
    cp_handle: CommHandle     # its context-parallel group's
    rng: RNGTracker           # its generator states, per RNG region


ModuleSpec = SyncSpec | SequenceSpec | GatherSpec | CrossEntropySpec | RandomOpSpec | ContextGatherSpec \
    | RingAttentionSpec | Fp8LinearSpec

# spec type -> the rank resource its `build` takes (a tuple: the resources, in its arguments' order)
COLLECTIVES: dict[type, str | tuple[str, ...]] = {
    SyncSpec: "handle",            # sync_<param>: rows of a parameter held by several ranks (GQA)
    SequenceSpec: "handle",        # sequence parallelism's reduce-scatter / all-gather
    GatherSpec: "handle",          # gather_<node>: sharded outputs the model returns
    CrossEntropySpec: "handle",    # vocab_cross_entropy_<node>: the loss on vocabulary shards
    RandomOpSpec: "rng",           # <region>_rng_<node>: a random op under its region's generator
    ContextGatherSpec: "cp_handle",  # cp_gather_<node>: keys or values of every token (context parallelism)
    RingAttentionSpec: "cp_handle",  # cp_ring_<node>: SDPA with the keys passed around the context-parallel ring
    Fp8LinearSpec: ("handle", "cp_handle"),   # fp8_<node>: a linear in float8, amaxes over tp and cp where they split it
}


def row_for(table: dict, item: object, what: str, where: str):
    """`table[type(item)]`, or a TypeError saying that nothing is registered for `what` and which
    table (`where`) takes the row (regions/registry.py's registry reads its rows this way too)."""
    try:
        return table[type(item)]
    except KeyError:
        raise TypeError(f"no module is registered for {what}; add a row to {where}") from None


def build_module(spec: ModuleSpec, rank: RankResources) -> nn.Module:
    resource = row_for(COLLECTIVES, spec, f"{type(spec).__name__} ({spec.module})",
                       "autoshard/parallel/registry.py's COLLECTIVES")
    resources = resource if isinstance(resource, tuple) else (resource,)
    return spec.build(*(getattr(rank, r) for r in resources))
