"""The models people train now (issue: sinks, complex rotary, latent attention, full-width q/k norms,
in-place ops), from small configs: every attention and MLP weight a Megatron split shards is split at
tp=2, tp=4 and tp=2 x pp=2, with a padding mask and -100 labels, against the single-device model.

What stays whole stays whole by design and `print(prog)` says so: routers (a top-k over experts),
MLA's low-rank down-projections (q_a, kv_a), a masked-LM head's dense transform before its norm.
"""
import re

import pytest
import torch

from autoshard import autoshard
from autoshard.errors import CaptureError
from autoshard.testing import grad_errors, max_rel
from tests.harness.one_device import split_and_match
from autoshard.testing.current_models import CURRENT_MODELS, build_current

hf = pytest.importorskip("transformers")

# what is kept whole by design, per model, as parts of parameter names (every other block weight of
# >= 2 dims must be split): routers, MLA's down-projections, a masked-LM head's transform, and the
# experts' row-parallel bias (added once, after the reduction, as Megatron adds a row-parallel bias)
BY_DESIGN = {
    "GptOss": {"mlp.router.", "experts.down_proj_bias"}, "Llama4": {"feed_forward.router."},
    "DeepseekV2": {"self_attn.kv_a_proj_with_mqa.", "mlp.gate."},
    "DeepseekV3": {"self_attn.kv_a_proj_with_mqa.", "self_attn.q_a_proj.", "mlp.gate."},
    "JetMoe": {"mlp.router.layer.", "self_attention.experts.router.layer."}, "MPNet": {"lm_head.dense."},
}
_BLOCK = re.compile(r"\.\d+\.")


def _inputs():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, 128, (2, 16), generator=g)
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[1, :5] = 0                                   # left padding on the second row
    labels = torch.randint(0, 128, (2, 16), generator=g)
    labels[mask == 0] = -100
    labels[0, 3] = -100
    return dict(input_ids=ids, attention_mask=mask, labels=labels)


def _whole(name: str, arch: str) -> bool:
    """`name`: a parameter's name, or a module path followed by a dot."""
    return any(part in name for part in BY_DESIGN.get(arch, ()))


@pytest.mark.parametrize("tp,pp", [(2, 1), (4, 1), (2, 2)])
@pytest.mark.parametrize("arch", sorted(CURRENT_MODELS))
def test_current_models_shard_every_weight_megatron_splits(arch, tp, pp):
    model = build_current(arch)
    prog = split_and_match(model, _inputs(), tp, pp)
    assert all(f.by_design for f in prog.sharding.fallbacks), prog.sharding.fallbacks
    for f in prog.sharding.fallbacks:
        assert all(_whole(m.split(" (")[0] + ".", arch) for m in f.modules), f
        assert f"whole by design (replicated): {', '.join(f.modules)}" in str(prog)
    for name, p in model.named_parameters():
        if p.dim() >= 2 and _BLOCK.search(name) and not _whole(name, arch):
            assert name in prog.sharding.params, f"{name} stays whole"


class _ExpertsHit(torch.nn.Module):
    """A loop over the experts that received tokens, in a module of no known form."""

    def __init__(self, experts: int = 4, width: int = 8):
        super().__init__()
        self.num_experts = experts
        self.w = torch.nn.Parameter(torch.randn(experts, width, width))

    def forward(self, x, top_k_index):
        out = torch.zeros_like(x)
        for e in torch.unique(top_k_index):
            rows = (top_k_index == e).any(-1).nonzero().squeeze(-1)
            out = out.index_add(0, rows, x[rows] @ self.w[e])
        return out


def test_a_loop_over_the_experts_hit_is_exported_densely_or_refused_naming_the_loop():
    """DBRX's experts loop over the experts hit (before: "torch.export could not trace
    DbrxForCausalLM: GuardOnDataDependentSymNode ..."): exported as the same sum over every expert
    (autoshard/compile/dense_experts.py), exact against the model's own loop at tp=2 x pp=2. A
    loop of no known form is refused naming the loop and the change; an experts module that has
    transformers' experts interface is told to switch it."""
    cfg = hf.DbrxConfig(d_model=64, n_heads=8, n_layers=2, max_seq_len=64, vocab_size=128,
                        attn_config={"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
                        ffn_config={"ffn_hidden_size": 64, "moe_num_experts": 4, "moe_top_k": 2})
    torch.manual_seed(0)
    dbrx = hf.DbrxForCausalLM(cfg)
    for p in dbrx.parameters():
        torch.nn.init.normal_(p, std=0.05)          # DBRX's init leaves the experts at zero
    split_and_match(dbrx, _inputs(), tp=2, pp=2)
    with pytest.raises(CaptureError) as e:
        autoshard(_ExpertsHit(), tp=2, example_inputs=(torch.randn(6, 8), torch.randint(0, 4, (6, 2))))
    text = str(e.value)
    assert "`for e in torch.unique(top_k_index):`" in text and "<top> (_ExpertsHit.forward)" in text
    assert "range(num_experts)" in text
    mixtral = hf.MixtralConfig(vocab_size=128, hidden_size=64, num_hidden_layers=1, num_attention_heads=8,
                               num_key_value_heads=2, intermediate_size=64, num_local_experts=4)
    mixtral._experts_implementation = "eager"
    with pytest.raises(CaptureError, match='_experts_implementation = "grouped_mm"'):
        autoshard(hf.MixtralForCausalLM(mixtral).eval(), tp=2,
                  example_kwargs={"input_ids": torch.randint(0, 128, (2, 8))})


def test_a_model_taking_use_cache_through_kwargs_is_captured_without_its_cache():
    # before: "torch.export could not trace GraniteMoeForCausalLM: RuntimeError: Found <class
    # 'transformers.cache_utils.DynamicCache'> in output" (use_cache only through **kwargs, read from
    # the config)
    cfg = hf.GraniteMoeConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=8,
                              num_key_value_heads=4, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2)
    torch.manual_seed(0)
    model = hf.GraniteMoeForCausalLM(cfg).eval()
    kw = _inputs()
    prog = autoshard(model, tp=2, example_kwargs=kw)
    assert model.config.use_cache is True                     # restored after the trace
    assert max_rel(prog.simulate(**kw).loss, model(**kw).loss) <= 1e-5
    assert "model.layers.0.block_sparse_moe.experts.gate_up_proj" in prog.sharding.params


def test_a_k_norm_over_key_value_heads_fewer_than_tp_is_a_distributed_norm():
    """OLMo 3 at tp=4 with 2 kv heads: each kv head is held by 2 ranks, so the k_norm's statistic
    (over all kv heads' features) is summed over the ranks and divided by the 2 copies. Before:
    "node mean_1 (k_norm) reduces over sharded dim 2", and k_proj stayed whole."""
    cfg = hf.Olmo3Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = hf.Olmo3ForCausalLM(cfg)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.k_norm.weight.add_(0.1 * torch.randn(32))     # off its initial ones
    kw = _inputs()
    ref = model(**kw)
    ref.loss.backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    prog = autoshard(model, tp=4, example_kwargs=kw)
    assert prog.sharding.fallbacks == [], prog.sharding.fallbacks
    assert {"model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.k_norm.weight"} <= set(prog.sharding.params)
    out = prog.simulate(**kw)
    assert max_rel(out.loss, ref.loss) <= 1e-5 and max_rel(out.logits, ref.logits) <= 1e-5
    out.loss.backward()
    errs = grad_errors(prog.full_grads(), ref_grads)
    assert max(errs.values()) <= 1e-5, max(errs.items(), key=lambda kv: kv[1])
