"""Names that changed with the layout still work for one release, each with a DeprecationWarning
naming its replacement; and every module spec the rewrite emits has a row in the registry."""
import importlib
import sys

import pytest
import torch

import autoshard
from autoshard import autoshard as shard
from autoshard.parallel.comm import CommHandle
from autoshard.parallel.random_ops import RANDOM_OPS
from autoshard.parallel.registry import COLLECTIVES, build_module
from autoshard.parallel.rng import RandomOpSpec, RNGTracker
from autoshard.parallel.sequence_parallel import SequenceSpec
from autoshard.parallel.tensor_parallel import SyncSpec
from autoshard.parallel.vocab_parallel import CrossEntropySpec, GatherSpec
from autoshard.planning.costmodel import estimate
from autoshard.testing import build_model

GPT3 = dict(hidden=12288, layers=96, heads=96, vocab=51200, seq=2048)


def test_program_plan_and_estimate_are_sharding_and_planned():
    prog = shard(build_model("nanogpt"), tp=2)
    with pytest.warns(DeprecationWarning, match="ShardedProgram.plan is deprecated.*ShardedProgram.sharding"):
        assert prog.plan is prog.sharding
    with pytest.warns(DeprecationWarning, match="use ShardedProgram.planned"):
        assert prog.estimate is prog.planned is None
    with pytest.warns(DeprecationWarning, match="use RankProgram.tp"):
        assert prog.rank(1).world_size == prog.rank(1).tp == 2


def test_pipeline_runtime_is_mesh_runtime():
    with pytest.warns(DeprecationWarning, match="autoshard.PipelineRuntime is deprecated.*MeshRuntime"):
        assert autoshard.PipelineRuntime is autoshard.MeshRuntime


def test_estimate_v_is_virtual():
    with pytest.warns(DeprecationWarning, match="estimate\\(v=...\\)"):
        old = estimate(tp=8, pp=12, dp=8, global_batch=768, microbatch=1, v=2, **GPT3)
    new = estimate(tp=8, pp=12, dp=8, global_batch=768, microbatch=1, virtual=2, **GPT3)
    assert old == new and new.virtual == 2
    with pytest.warns(DeprecationWarning, match="Estimate.v"):
        assert new.v == 2


@pytest.mark.parametrize("old, new", [("autoshard.costmodel", "autoshard.planning.costmodel"),
                                      ("autoshard.pipeline", "autoshard.runtime.executor"),
                                      ("autoshard.passes.annotate", "autoshard.passes.sharding.annotate")])
def test_old_module_paths_import_the_moved_modules(old, new):
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=f"{old} is deprecated.*use {new}"):
        module = importlib.import_module(old)
    assert module is importlib.import_module(new)


def test_the_old_rewrite_module_serves_its_names_from_their_new_homes():
    import autoshard.passes.rewrite as old
    from autoshard.passes.rewrite.rank_rewrite import rewrite_rank
    with pytest.warns(DeprecationWarning, match="use autoshard.passes.rewrite.rank_rewrite.rewrite_rank"):
        assert old.rewrite_rank is rewrite_rank
    with pytest.warns(DeprecationWarning, match="use autoshard.parallel.tensor_parallel.SyncSpec"):
        assert old.SyncSpec is SyncSpec
    with pytest.raises(AttributeError):
        old.nothing_like_this


def test_schedule_chunks_flag_is_virtual(capsys):
    from autoshard.cli import main
    main(["schedule", "--pp", "2", "--chunks", "2", "--microbatches", "4"])
    out = capsys.readouterr()
    assert "--chunks is deprecated" in out.err and "use --virtual" in out.err
    main(["schedule", "--pp", "2", "--virtual", "2", "--microbatches", "4"])
    assert capsys.readouterr().out == out.out


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
