"""Dropout masks: equal across tensor-parallel ranks outside TP regions, different inside,
reproducible from one seed (Megatron's RNG tracker)."""
import pytest
import torch

from autoshard import autoshard

hf = pytest.importorskip("transformers")


def _gpt2(p=0.3):
    torch.manual_seed(0)
    cfg = hf.GPT2Config(n_layer=2, n_head=8, n_embd=64, vocab_size=128, n_positions=64,
                        resid_pdrop=p, embd_pdrop=p, attn_pdrop=p)
    return hf.GPT2LMHeadModel(cfg).train()


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
