"""Small configs of the models people train now (transformers 5), for the tests and benchmarks that
check how fully they shard: tests/simulation/test_current_models.py, benchmarks/param_share.py.

    model = build_current("GptOss")          # random weights, eval mode; nothing downloads
"""
from __future__ import annotations

import torch
from torch import nn

__all__ = ["CURRENT_MODELS", "build_current"]

COMMON = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=8, intermediate_size=128)
_MOE = dict(num_local_experts=4, num_experts_per_tok=2)
_MLA = dict(kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8, moe_intermediate_size=32,
            n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1, n_shared_experts=1, n_group=1,
            topk_group=1, num_key_value_heads=8)
CURRENT_MODELS = {
    # attention sinks (a max over scores and sinks), interleaved gate/up columns, biased experts
    "GptOss": ("GptOssConfig", "GptOssForCausalLM", dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, **_MOE,
        layer_types=["sliding_attention", "full_attention"], sliding_window=8)),
    # complex rotary (view_as_complex), experts as bmm on stacked weights, chunked attention
    "Llama4": ("Llama4TextConfig", "Llama4ForCausalLM", dict(
        num_key_value_heads=4, head_dim=8, intermediate_size_mlp=128, num_local_experts=4, num_experts_per_tok=1,
        interleave_moe_layer_step=1, attention_chunk_size=8, no_rope_layers=[1, 0])),
    # MLA without a q down-projection, complex rotary, keys built with new_empty + copy_
    "DeepseekV2": ("DeepseekV2Config", "DeepseekV2ForCausalLM", dict(q_lora_rank=None, **_MLA)),
    "DeepseekV3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(q_lora_rank=32, **_MLA)),
    # q/k RMSNorm over all heads' features: a distributed norm
    "Olmo2": ("Olmo2Config", "Olmo2ForCausalLM", dict(num_key_value_heads=8, eos_token_id=1, pad_token_id=0)),
    "Olmo3": ("Olmo3Config", "Olmo3ForCausalLM", dict(num_key_value_heads=4, sliding_window=8, eos_token_id=1,
                                                     pad_token_id=0)),
    # a LayerNorm module per head
    "StableLm": ("StableLmConfig", "StableLmForCausalLM", dict(num_key_value_heads=8, qk_layernorm=True,
                                                               hidden_dropout=0.0, attention_dropout=0.0)),
    # xIELU activation (min / max against a scalar)
    "Apertus": ("ApertusConfig", "ApertusForCausalLM", dict(num_key_value_heads=4)),
    # attention experts (selected per expert in a Python loop), kv heads repeated per top-k slot
    "JetMoe": ("JetMoeConfig", "JetMoeForCausalLM", dict(num_key_value_heads=4, kv_channels=8, **_MOE)),
    # relative position bias added in place
    "MPNet": ("MPNetConfig", "MPNetForMaskedLM", dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                                      max_position_embeddings=64)),
}

def build_current(name: str, seed: int = 0) -> nn.Module:
    import transformers as hf
    cfg_name, model_name, extra = CURRENT_MODELS[name]
    torch.manual_seed(seed)
    return getattr(hf, model_name)(getattr(hf, cfg_name)(**{**COMMON, **extra})).eval()
