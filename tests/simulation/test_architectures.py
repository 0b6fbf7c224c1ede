"""Other Hugging Face decoders, built from small configs: each shards correctly or is refused."""
import pytest
import torch
import torch.nn.functional as F

from autoshard import ShardingError, autoshard
from autoshard.testing import fused_ops, grad_errors, max_rel

hf = pytest.importorskip("transformers")

COMMON = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=8, intermediate_size=128)
CASES = {
    "Mistral": ("MistralConfig", "MistralForCausalLM", dict(num_key_value_heads=2)),
    "Qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(num_key_value_heads=4)),
    "Qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(num_key_value_heads=2, head_dim=8)),
    "Phi3": ("Phi3Config", "Phi3ForCausalLM", dict(num_key_value_heads=4, pad_token_id=0)),
    "GPTNeoX": ("GPTNeoXConfig", "GPTNeoXForCausalLM", dict(hidden_dropout=0.0, attention_dropout=0.0)),
    "OPT": ("OPTConfig", "OPTForCausalLM", dict(ffn_dim=128, dropout=0.0, attention_dropout=0.0,
                                                 word_embed_proj_dim=64, max_position_embeddings=64)),
    "Gemma": ("GemmaConfig", "GemmaForCausalLM", dict(num_key_value_heads=1, head_dim=8)),
    # soft-capped attention scores, so eager attention: 2 kv heads repeated in code for 8 query heads
    "Gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(num_key_value_heads=2, head_dim=8)),
    "GPTJ": ("GPTJConfig", "GPTJForCausalLM", dict(n_embd=64, n_layer=2, n_head=8, rotary_dim=4,
                                                   resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)),
    "Falcon": ("FalconConfig", "FalconForCausalLM", dict(hidden_dropout=0.0, attention_dropout=0.0)),
    # alibi (size arithmetic on SymInts in the graph); Bloom's fused qkv is viewed per head, then batch
    # and heads merged for baddbmm and bmm
    "Bloom": ("BloomConfig", "BloomForCausalLM", dict(n_layer=2, n_head=8, hidden_dropout=0.0, attention_dropout=0.0)),
    # disentangled attention: batch and heads merged, relative-position keys repeated per sample, scores
    # gathered along the keys
    "DebertaV2": ("DebertaV2Config", "DebertaV2ForMaskedLM", dict(
        max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, relative_attention=True,
        pos_att_type=["p2c", "c2p"], position_buckets=16, max_relative_positions=32, pad_token_id=0)),
    "MPT": ("MptConfig", "MptForCausalLM", dict(d_model=64, n_heads=8, n_layers=2, expansion_ratio=2)),
    # partial rotary, attention and MLP in parallel, biases
    "Phi": ("PhiConfig", "PhiForCausalLM", dict(resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0,
                                                 partial_rotary_factor=0.5)),
    # multi-query fused c_attn
    "GPTBigCode": ("GPTBigCodeConfig", "GPTBigCodeForCausalLM", dict(n_embd=64, n_layer=2, n_head=8, n_inner=128,
                                                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)),
    # RMSNorm over all heads' q and k features (a distributed norm: its statistic summed by g)
    "Olmo2": ("Olmo2Config", "Olmo2ForCausalLM", dict(num_key_value_heads=8)),
    # Mixture of Experts: top-k routing
    "Qwen2Moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(num_key_value_heads=2, moe_intermediate_size=32,
                                                               shared_expert_intermediate_size=64, num_experts=4,
                                                               num_experts_per_tok=2)),
}
# The ones that must shard their attention and MLP weights with no fallback but those by design,
# named here (others may fall back, correctly: Falcon's fused multi-query QKV indexed with lists,
# Qwen2-MoE's router). GPT-BigCode's multi-query attention and Gemma2's eager attention with 2 kv heads
# at tp=4 share kv heads between ranks.
MUST_SHARD = {"Mistral", "Qwen2", "Qwen3", "Phi3", "GPTNeoX", "OPT", "Gemma", "Gemma2", "GPTJ", "MPT", "Phi",
              "GPTBigCode", "Olmo2", "Bloom", "DebertaV2"}
BY_DESIGN = {"DebertaV2": ("cls.predictions.transform.dense (Linear)",)}     # a masked-LM head's transform
# What the fusion pass finds in each at tp=2 (a row-parallel linear's bias is added after its
# all-reduce, so bias + residual appears in the models whose output projections have biases).
# Not fused: GPT-J's interleaved rotary, OPT's ReLU, Gemma's gated GeLU (no kernel
# or no pattern); what is left unfused still runs as the model wrote it.
_LLAMA_LIKE = {"rms_norm", "rotary", "swiglu"}
FUSED = {"Mistral": _LLAMA_LIKE, "Qwen2": _LLAMA_LIKE, "Qwen3": _LLAMA_LIKE, "Phi3": _LLAMA_LIKE,
         "Gemma": {"rms_norm", "rotary"}, "Gemma2": {"rms_norm", "rotary"}, "Falcon": {"layer_norm", "rotary"},
         "GPTNeoX": {"layer_norm", "rotary", "bias_gelu", "bias_residual"},
         "GPTJ": {"layer_norm", "gelu_tanh", "bias_residual"}, "OPT": {"layer_norm", "bias_residual"},
         "Bloom": {"layer_norm", "bias_residual"}, "MPT": {"layer_norm"},
         "DebertaV2": {"layer_norm", "bias_gelu", "bias_residual"},
         "Phi": {"layer_norm", "gelu_tanh", "rotary", "bias_residual"},
         "GPTBigCode": {"layer_norm", "bias_gelu", "bias_residual"}, "Olmo2": _LLAMA_LIKE, "Qwen2Moe": _LLAMA_LIKE}


@pytest.mark.parametrize("tp,fuse", [(2, False), (4, False), (2, True)])
@pytest.mark.parametrize("arch", sorted(CASES))
def test_shards_correctly_or_refuses(arch, tp, fuse):
    """Fused (on the CPU the fused ops' torch implementations) as well as plain."""
    cfg_name, model_name, extra = CASES[arch]
    torch.manual_seed(0)
    model = getattr(hf, model_name)(getattr(hf, cfg_name)(**{**COMMON, **extra})).eval()
    ids, labels = torch.randint(0, 128, (2, 16)), torch.randint(0, 128, (2, 16))
    try:
        prog = autoshard(model, tp=tp, example_kwargs={"input_ids": ids}, fuse=fuse)
    except ShardingError as e:
        assert f"tp={tp}" in str(e) and "module" in str(e)
        assert arch not in MUST_SHARD
        return
    ref = model(input_ids=ids).logits
    F.cross_entropy(ref.reshape(-1, 128), labels.reshape(-1)).backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    assert set(fused_ops(prog.rank(0).graph_module)) == (FUSED[arch] if fuse else set())
    out = prog.simulate(input_ids=ids).logits
    assert max_rel(out, ref) <= 1e-5
    F.cross_entropy(out.reshape(-1, 128), labels.reshape(-1)).backward()
    assert max(grad_errors(prog.full_grads(), ref_grads).values()) <= 1e-4
    _every_whole_block_weight_is_explained(prog, model)
    if arch in MUST_SHARD:
        assert any(k in n for k in ("mlp", ".fc", "ffn", "intermediate.") for n in prog.sharding.params)
        assert any("attn" in n or "attention" in n for n in prog.sharding.params)
        assert [f for f in prog.sharding.fallbacks if not f.by_design or f.modules != BY_DESIGN.get(arch)] == [], \
            prog.sharding.fallbacks


def _every_whole_block_weight_is_explained(prog, model):
    """print(prog) gives a reason for every weight of >= 2 dims in a repeated block that stays
    whole, and no fallback line names a module whose weights the table shows split. Before: Qwen2-MoE's
    3-D expert weights stayed whole with no reason."""
    import re
    text = str(prog)
    reasons = [line for line in text.splitlines() if line.startswith(("fallback (replicated):", "whole by design (replicated):", "not sharded:"))]
    for name, p in model.named_parameters():
        if p.dim() >= 2 and re.search(r"\.\d+\.", name) and name not in prog.sharding.params:
            module = name.rsplit(".", 1)[0]
            assert any(name in line or f"{module} (" in line for line in reasons), f"{name} stays whole, no reason given"
    for f in prog.sharding.fallbacks:
        for module in f.modules:
            path = module.split(" (")[0]
            split = [n for n in prog.sharding.params if n.rsplit(".", 1)[0] == path]
            whole = [n for n, p in model.named_parameters() if n.rsplit(".", 1)[0] == path and n not in prog.sharding.params]
            assert whole or not split, f"fallback names {path}, whose weights {split} are split"
