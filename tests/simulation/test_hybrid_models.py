"""The 2025-2026 hybrids (issue 59), from small configs of the Hugging Face classes: every attention,
MLP and mixer projection split at tp=2, tp=4, pp=2 and tp=2 x pp=2, with a padding mask and -100
labels, against the single-device model (loss, logits, gradients). So far: LFM2's gated short
convolution (in_proj, the depthwise conv1d and out_proj split by channel)."""
import re

import pytest
import torch

from autoshard import autoshard
from autoshard.testing import grad_errors, max_rel

hf = pytest.importorskip("transformers")

VOCAB = 128


def _lfm2():
    cfg = hf.Lfm2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, conv_bias=True,
                        layer_types=["conv", "full_attention", "conv", "full_attention"])
    return hf.Lfm2ForCausalLM(cfg)


HYBRIDS = {"Lfm2": _lfm2}
_BLOCK = re.compile(r"\.\d+\.")


def _inputs():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, VOCAB, (2, 16), generator=g)
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[1, :5] = 0                                   # left padding on the second row
    labels = torch.randint(0, VOCAB, (2, 16), generator=g)
    labels[mask == 0] = -100
    labels[0, 3] = -100
    return dict(input_ids=ids, attention_mask=mask, labels=labels)


def _trained_looking(model):
    """Norm weights and biases off their initial values (ones and zeros hide a wrong split)."""
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn(p.shape, generator=g))


@pytest.mark.parametrize("tp,pp", [(2, 1), (4, 1), (1, 2), (2, 2)])
@pytest.mark.parametrize("arch", sorted(HYBRIDS))
def test_hybrid_models_split_every_mixer_projection(arch, tp, pp):
    torch.manual_seed(0)
    model = HYBRIDS[arch]()
    _trained_looking(model)
    kw = _inputs()
    ref = model(**kw)
    ref.loss.backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    mesh = dict(pp=pp, microbatches=2) if pp > 1 else {}
    prog = autoshard(model, tp=tp, example_kwargs=kw, **mesh)
    assert prog.sharding.fallbacks == [], prog.sharding.fallbacks
    if tp > 1:
        for name, p in model.named_parameters():
            if p.dim() >= 2 and _BLOCK.search(name):
                assert name in prog.sharding.params, f"{name} stays whole"
    out = prog.simulate(**kw)
    assert max_rel(out.loss, ref.loss) <= 1e-5
    if pp == 1:
        assert max_rel(out.logits, ref.logits) <= 1e-5
    out.loss.backward()
    errs = grad_errors(prog.full_grads(), ref_grads)
    assert max(errs.values()) <= 1e-5, max(errs.items(), key=lambda kv: kv[1])
