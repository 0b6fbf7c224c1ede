"""Dropout masks: equal across tensor-parallel ranks outside TP regions, different inside,
reproducible from one seed (Megatron's RNG tracker)."""
import pytest
import torch

from autoshard import autoshard
from autoshard.testing import build_model

pytest.importorskip("transformers")


def _gpt2(p=0.3):
    return build_model("gpt2", dropout=p).train()


@pytest.fixture(scope="module")
def prog():
    ids = torch.randint(0, 128, (2, 16))
    return autoshard(_gpt2(), tp=4, example_kwargs={"input_ids": ids}), ids


def _ones_through(rank, region_prefix):
    mod = next(m for n, m in rank.named_children() if n.startswith(region_prefix))
    if "scaled_dot_product_attention" in str(mod.op):
        q = torch.ones(1, 2, 64, 8)
        return mod(q, q, q, None, 0.5)
    return mod(torch.ones(4096), 0.5, True)


def test_masks_equal_across_ranks_outside_tp_regions(prog):
    p, ids = prog
    masks = [_ones_through(r, "replicated_rng") for r in p.ranks()]
    assert all(torch.equal(m, masks[0]) for m in masks)
    # end to end: replicas stay equal under training dropout, so every rank returns the same logits
    outs = [o.logits for o in p.simulate_all(input_ids=ids)]
    assert all(torch.equal(o, outs[0]) for o in outs)


def test_masks_differ_across_ranks_inside_tp_regions(prog):
    p, _ = prog
    masks = [_ones_through(r, "tp_rng") for r in p.ranks()]
    assert all(not torch.equal(masks[0], m) for m in masks[1:])


def test_same_seed_same_masks_other_seed_other_masks(prog):
    p, ids = prog
    p.manual_seed(7)
    a = p.simulate(input_ids=ids).logits
    p.manual_seed(7)
    b = p.simulate(input_ids=ids).logits
    p.manual_seed(8)
    c = p.simulate(input_ids=ids).logits
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_global_generator_is_left_alone(prog):
    p, ids = prog
    torch.manual_seed(123)
    want = torch.rand(3)
    torch.manual_seed(123)
    p.simulate(input_ids=ids)
    assert torch.equal(torch.rand(3), want)


def test_eval_turns_dropout_off():
    model = _gpt2()
    ids = torch.randint(0, 128, (2, 16))
    p = autoshard(model, tp=2, example_kwargs={"input_ids": ids})
    for r in p.ranks():
        r.eval()
    ref = model.eval()(input_ids=ids).logits
    assert (p.simulate(input_ids=ids).logits - ref).abs().max() <= 1e-5 * ref.abs().max()


# ---- the fused bias + dropout + residual (fuse=True): same region rules, its own masks -------------
@pytest.fixture(scope="module")
def fused_prog():
    ids = torch.randint(0, 128, (2, 16))
    return autoshard(_gpt2(), tp=4, example_kwargs={"input_ids": ids}, fuse=True), ids


def _fused_dropouts(rank):
    return [m for n, m in rank.named_children() if n.startswith("replicated_rng_fused_")]


def test_training_dropout_is_fused_under_its_region(fused_prog):
    """Every residual dropout (2 per layer) runs fused, under the replicated region: all ranks
    draw the same masks, so they return the same logits; one seed reproduces a run."""
    p, ids = fused_prog
    assert len(_fused_dropouts(p.rank(0))) == 4
    assert "dropout.default" not in " ".join(str(m.op) for m in _fused_dropouts(p.rank(0)))
    outs = [o.logits for o in p.simulate_all(input_ids=ids)]
    assert all(torch.equal(o, outs[0]) for o in outs)
    p.manual_seed(7)
    a = p.simulate(input_ids=ids).logits
    p.manual_seed(7)
    b = p.simulate(input_ids=ids).logits
    p.manual_seed(8)
    assert torch.equal(a, b) and not torch.equal(a, p.simulate(input_ids=ids).logits)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU"))])
def test_fused_dropout_drops_p_scales_the_rest_and_backward_uses_the_same_mask(fused_prog, device):
    """On CUDA the kernel draws the mask: the same one the torch implementation draws on the CPU
    from the same region state."""
    p, _ = fused_prog
    mods = [_fused_dropouts(r)[0] for r in p.ranks()]
    rate, n = 0.3, 64 * 4096
    y = torch.ones(64, 4096, device=device, requires_grad=True)
    zeros = torch.zeros(64, 4096, device=device)
    p.manual_seed(3)
    outs = [m(y, zeros[0], zeros, rate, 0) for m in mods]
    if device == "cuda":
        p.manual_seed(3)
        on_cpu = mods[0](y.detach().cpu(), zeros[0].cpu(), zeros.cpu(), rate, 0)
        assert torch.equal(outs[0].cpu() != 0, on_cpu != 0)
        assert torch.allclose(outs[0].cpu(), on_cpu, rtol=1e-6, atol=0)
    assert all(torch.equal(o, outs[0]) for o in outs)               # replicated region: one mask
    out = outs[0]
    kept = out != 0
    assert abs((1 - kept.float().mean().item()) - rate) < 4 * (rate * (1 - rate) / n) ** 0.5
    assert torch.allclose(out[kept], torch.full_like(out[kept], 1 / (1 - rate)))
    (grad,) = torch.autograd.grad(out.sum(), y)
    assert torch.equal(grad, out)          # d out / d y = mask / (1 - p), and out = mask / (1 - p) here
    again = mods[0](y, zeros[0], zeros, rate, 0)
    assert not torch.equal(again, out)                              # the next call draws a new seed


def test_fused_dropout_under_sequence_parallelism_is_per_rank():
    """With sequence parallelism the residual stream holds each rank's own tokens: their dropout
    runs in the tensor-parallel region, fused or not."""
    ids = torch.randint(0, 128, (2, 16))
    p = autoshard(_gpt2(), tp=2, example_kwargs={"input_ids": ids}, fuse=True, sequence_parallel=True)
    fused = [m for n, m in p.rank(0).named_children() if "_rng_fused_" in n]
    assert fused and {m.region for m in fused} == {"tensor_parallel"}


def test_eval_turns_fused_dropout_off():
    model = _gpt2()
    ids = torch.randint(0, 128, (2, 16))
    p = autoshard(model, tp=2, example_kwargs={"input_ids": ids}, fuse=True)
    assert _fused_dropouts(p.rank(0))
    for r in p.ranks():
        r.eval()
    ref = model.eval()(input_ids=ids).logits
    assert (p.simulate(input_ids=ids).logits - ref).abs().max() <= 1e-5 * ref.abs().max()
