"""The registry of modules a rank builds for the regions the passes outline: region type -> builder.

The passes cut regions out of a rank graph and leave one `call_module` node for each (experts calls:
passes/outline_experts.py; recomputed layers: passes/recompute.py; size-only tables:
passes/tables.py). `build_region_module` turns a region into the module that node calls, as
parallel/registry.py's `build_module` does for the collectives' specs. Adding a kind of region is
its pass, its module and one row below. A region's body is a graph over the rank module (it reads
the rank's parameters and calls its other modules), so each builder receives the rank.
"""
from __future__ import annotations

from typing import Callable, Protocol

import torch.fx as fx
from torch import nn

from autoshard.regions.experts_call import ExpertsCall, weightless_copy
from autoshard.regions.recompute import Recompute
from autoshard.regions.tables import TableCache
from autoshard.parallel.registry import row_for
from autoshard.parallel.rng import RNGTracker
from autoshard.passes.outline_experts import ExpertRegion
from autoshard.passes.recompute import RecomputeRegion
from autoshard.passes.tables import TableRegion

__all__ = ["REGION_MODULES", "RankForRegions", "build_region_module"]


class RankForRegions(nn.Module):
    """What a rank lends the region modules it builds (compile/rank.py's RankProgram)."""

    f: nn.Module                              # tensor parallelism's f and g, for experts split over tp
    g: nn.Module
    rng: RNGTracker                           # replayed by recomputation
    expert_group: object                      # expert parallelism's group, once bound
    expert_templates: dict[str, nn.Module]    # path -> the model's experts module, without weights


def _experts_call(region: ExpertRegion, rank: RankForRegions) -> nn.Module:
    body = fx.GraphModule(rank, region.graph, class_name="ExpertsRegion")
    call = ExpertsCall(body, region, weightless_copy(rank.expert_templates[region.path]), rank.f, rank.g)
    if rank.expert_group is not None:
        call.bind(rank.expert_group)
    return call


def _recompute(region: RecomputeRegion, rank: RankForRegions) -> nn.Module:
    return Recompute(fx.GraphModule(rank, region.graph, class_name="RecomputedRegion"), rank.rng, region.layer,
                     region.mode)


def _table_cache(region: TableRegion, rank: RankForRegions) -> nn.Module:
    return TableCache(fx.GraphModule(rank, region.graph, class_name="Tables"))


# region type -> its module's builder. Built in this order: a recomputed layer's body calls its
# experts module, so experts calls come first.
REGION_MODULES: dict[type, Callable[[object, RankForRegions], nn.Module]] = {
    ExpertRegion: _experts_call,         # experts_<path>: the experts call, dispatched over ep when bound
    RecomputeRegion: _recompute,         # recompute_<layer>: run again in backward
    TableRegion: _table_cache,           # the size-only tables, computed once per shape
}


class _RegionLike(Protocol):
    name: str


def build_region_module(region: _RegionLike, rank: RankForRegions) -> nn.Module:
    build = row_for(REGION_MODULES, region, f"the region {region.name} ({type(region).__name__})",
                    "autoshard/regions/registry.py's REGION_MODULES")
    return build(region, rank)
