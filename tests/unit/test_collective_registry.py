"""Every module spec the rewrite emits has a row in the registry (parallel/registry.py), every
outlined region in regions/registry.py's, and a spec or region without one is refused naming it."""
import pytest
import torch

from autoshard.parallel.comm import CommHandle
from autoshard.parallel.random_ops import RANDOM_OPS
from autoshard.parallel.registry import COLLECTIVES, build_module
from autoshard.parallel.rng import RandomOpSpec, RNGTracker
from autoshard.parallel.sequence_parallel import SequenceSpec
from autoshard.parallel.tensor_parallel import SyncSpec
from autoshard.parallel.vocab_parallel import CrossEntropySpec, GatherSpec

class _Rank:
    handle = CommHandle(0, 2)
    rng = RNGTracker(0)


@pytest.mark.parametrize("spec", [
    SyncSpec("sync_w", "w", 0, 8, ((0, 4),)),
    SequenceSpec("rs", "reduce_scatter", 1, 1), SequenceSpec("ag", "all_gather_keep_grad", 1, 2),
    GatherSpec("gather_x", 1, 8, 7, ((0, 4),), True),
    CrossEntropySpec("ce", 0, 4, 4, -100, 1, 8),
    RandomOpSpec("tp_rng_d", torch.ops.aten.dropout.default, "tensor_parallel", RANDOM_OPS["dropout"]),
], ids=lambda s: type(s).__name__)
def test_every_spec_builds_its_module_from_the_registry(spec):
    module = build_module(spec, _Rank())
    assert type(spec) in COLLECTIVES
    assert isinstance(module, torch.nn.Module) and (getattr(module, "handle", None) is _Rank.handle
                                                    or getattr(module, "tracker", None) is _Rank.rng)


def test_an_unregistered_spec_is_refused_naming_the_registry():
    class NewSpec:
        module = "new_thing"
    with pytest.raises(TypeError, match="no module is registered for NewSpec \\(new_thing\\).*COLLECTIVES"):
        build_module(NewSpec(), _Rank())


def test_an_unregistered_region_is_refused_naming_its_registry():
    """Outlined regions (experts calls, recomputed layers, tables) build their modules through
    regions/registry.py's table, as the collectives do through theirs."""
    from autoshard.regions.registry import REGION_MODULES, build_region_module
    from autoshard.passes.outline_experts import ExpertRegion
    from autoshard.passes.recompute import RecomputeRegion
    from autoshard.passes.tables import TableRegion
    assert list(REGION_MODULES) == [ExpertRegion, RecomputeRegion, TableRegion]     # the build order

    class NewRegion:
        name = "new_region"
    with pytest.raises(TypeError, match=r"no module is registered for the region new_region \(NewRegion\).*REGION_MODULES"):
        build_region_module(NewRegion(), None)
