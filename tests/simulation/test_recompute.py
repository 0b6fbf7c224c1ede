"""Activation recomputation (`autoshard(recompute=...)`): the same losses and gradients as without,
dropout on, every mesh shape in simulation; the regions are readable in the rank code and the
recomputation really runs in backward."""
import pytest
import torch

import autoshard.regions.recompute as recompute_module
from autoshard import autoshard
from autoshard.errors import ShardingError
from autoshard.testing import build_model
from tests.harness.recompute_check import compare_simulated

pytest.importorskip("transformers")

MESHES = {"tp2": dict(tp=2), "pp2-v2": dict(tp=1, pp=2, virtual=2), "tp2-pp2": dict(tp=2, pp=2),
          "tp2-sp": dict(tp=2, sequence_parallel=True)}


@pytest.mark.parametrize("mesh", sorted(MESHES))
@pytest.mark.parametrize("mode", ["full", "selective"])
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_recompute_gives_the_same_losses_and_gradients(name, mode, mesh):
    r = compare_simulated(name, mode, **MESHES[mesh])
    assert r["regions"] == 4, r              # one region per layer, 4 layers
    assert r["bitwise"], r                   # the op order is unchanged: equal bit for bit


@pytest.mark.parametrize("mode", ["full", "selective"])
@pytest.mark.parametrize("fuse", [False, True])
def test_written_out_attention_and_fused_ops(mode, fuse):
    """nanoGPT with attention written out (the s^2 scores, softmax, dropout): fused (causal softmax,
    bias + dropout + residual drawing from a seed) or not."""
    r = compare_simulated("nanogpt-manual", mode, tp=2, fuse=fuse)
    assert r["regions"] == 4 and r["bitwise"], r


def test_the_check_sees_masks_that_are_not_replayed(monkeypatch):
    """With the RNG tracker's states not swapped back in for the recomputation, dropout draws new
    masks in backward and the comparison fails: it can fail."""
    def no_replay(trackers):
        import contextlib
        return contextlib.nullcontext(), contextlib.nullcontext()
    monkeypatch.setattr(recompute_module, "_replaying", no_replay)
    r = compare_simulated("gpt2", "full", tp=2)
    assert r["grad_rel"] > 1e-3, r


def _prog(mode, name="nanogpt-manual", **kw):
    model = build_model(name, layers=2, dropout=0.1).train()
    ids = torch.randint(0, 128, (2, 16))
    return autoshard(model, tp=2, recompute=mode, example_inputs=(ids, ids), **kw), ids


def test_regions_are_in_the_rank_code():
    prog, _ = _prog("full")
    code = prog.rank(0).code
    assert "self.recompute_h_0(" in code and "self.recompute_h_1(" in code
    region = prog.rank(0).recompute_h_0
    assert "full recompute of h.0" in repr(region)
    body = region.body.code
    assert "self.f(" in body and "self.g(" in body            # the layer's collectives run again


def test_selective_outlines_only_the_attention_core():
    prog, _ = _prog("selective")
    body = prog.rank(0).recompute_attention_h_0.body
    ops = {str(n.target) for n in body.graph.nodes if n.op == "call_function"}
    assert any("softmax" in op for op in ops), ops
    assert any("matmul" in op or "bmm" in op for op in ops), ops
    assert not any("linear" in op or "addmm" in op or "layer_norm" in op for op in ops), ops
    called = [n.target for n in body.graph.nodes if n.op == "call_module"]
    assert called and all("rng" in t for t in called), called        # the probabilities' dropout, no f/g


def test_recomputation_runs_in_backward(monkeypatch):
    """In simulation each region runs all tensor-parallel ranks' bodies in lockstep: once forward,
    once more in backward; under torch.no_grad nothing is kept and nothing runs again."""
    prog, ids = _prog("full")
    runs = []
    lockstep = recompute_module.run_lockstep

    def counted(gms, *a, **kw):
        runs.append(len(gms))
        return lockstep(gms, *a, **kw)
    monkeypatch.setattr(recompute_module, "run_lockstep", counted)
    loss = prog.simulate(ids, ids)[1]
    assert runs == [2, 2]                      # 2 layers, each over both ranks
    loss.backward()
    assert runs == [2, 2, 2, 2]                # and again in backward
    runs.clear()
    with torch.no_grad():
        prog.simulate(ids, ids)
    assert runs == [2, 2]


def test_eval_mode_and_a_new_signature_are_recomputed_too():
    prog, ids = _prog("full")
    prog.eval()
    ids2 = torch.randint(0, 128, (3, 8))
    out = prog.simulate(ids2, ids2)[1]
    out.backward()
    assert sum("recompute_" in n for n, _ in prog.rank(0).named_children()) == 4   # 2 per signature


def test_fused_dropout_inside_a_region_draws_its_seed_again():
    """The fused bias + dropout + residual op takes a seed drawn from its region's generator; inside a
    recomputed layer the replayed tracker gives it the same seed (the bitwise check above covers the
    values; this checks the op is there)."""
    prog, _ = _prog("full", fuse=True)
    body = prog.rank(0).recompute_h_0.body
    fused = [n.target for n in body.graph.nodes if n.op == "call_module" and "rng_fused" in n.target]
    assert fused, body.code


def test_a_planned_program_compiles_the_planners_recompute_mode():
    """autoshard(world_size=...) runs the plan's recompute mode (the planner assumes what it picks)."""
    from autoshard.planning.costmodel import estimate
    from autoshard.planning.hardware import get_hardware
    model = build_model("nanogpt", layers=4, hidden=64, heads=4)
    # 8 samples a step: activations outweigh the gradients (at 1, full's recomputed layer would not pay)
    size = dict(hidden=64, layers=4, heads=4, vocab=128, seq=64, tp=1, pp=1, dp=1, global_batch=8)
    least = {r: min(estimate(**size, microbatch=mb, recompute=r).memory_gib_per_gpu for mb in (1, 2, 4, 8))
             for r in ("selective", "full")}
    selective, full = least["selective"], least["full"]
    assert full < selective
    hw = get_hardware("a100-80gb", memory_gib=(selective + full) / 2 / 0.9)      # only full fits
    with pytest.warns(UserWarning, match="plan is for 64 tokens"):     # no example call: the block size, said
        prog = autoshard(model, world_size=1, global_batch=8, hardware=hw)
    assert prog.planned.recompute == "full" and prog.recompute == "full"
    assert "self.recompute_h_0(" in prog.rank(0).code
    with pytest.warns(UserWarning, match="plan is for 64 tokens"):
        with pytest.raises(ShardingError, match="world_size=1: no split of 1 GPUs fits"):
            autoshard(model, world_size=1, global_batch=8, hardware=hw, recompute="none")     # planned as asked
    with pytest.warns(UserWarning, match="plan is for 64 tokens"):
        roomy = autoshard(model, world_size=1, global_batch=1, recompute="selective")
    assert roomy.planned.recompute == "selective" and roomy.recompute == "selective"


def test_unknown_mode_is_refused():
    model = build_model("nanogpt", layers=2)
    with pytest.raises(ShardingError, match="recompute must be one of 'none', 'selective', 'full', got 'some'"):
        autoshard(model, tp=2, recompute="some")


def test_hugging_faces_gradient_checkpointing_is_honoured_as_full_recompute():
    """model.gradient_checkpointing_enable() did not survive capture: the numbers were right and no
    memory was saved. It now means recompute="full" unless recompute is given."""
    model = build_model("llama", layers=2)
    model.gradient_checkpointing_enable()
    ids = torch.randint(0, 128, (2, 16))
    kw = {"input_ids": ids, "labels": ids}
    code = autoshard(model, tp=2, example_kwargs=kw).rank(0).code
    assert code.count("recompute_") >= 2, code
    assert "recompute_" not in autoshard(model, tp=2, example_kwargs=kw, recompute="none").rank(0).code
    prog = autoshard(model, tp=2, example_kwargs=kw)
    out, ref = prog.simulate(**kw), model(**kw)
    out.loss.backward()
    ref.loss.backward()
    grads = prog.full_grads()
    assert abs(out.loss.item() - ref.loss.item()) <= 1e-5 * ref.loss.item()
    assert max((grads[n] - p.grad).abs().max() / p.grad.abs().max() for n, p in model.named_parameters()) <= 1e-5
