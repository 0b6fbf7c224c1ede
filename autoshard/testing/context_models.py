"""Small Hugging Face decoders covering the attention forms context parallelism reads, for
tests/simulation/test_context_parallel.py and benchmarks/context_parallel.py:

    model = build_context("gemma2")          # random weights, eval mode; nothing downloads

Each row names the form it brings: SDPA with GQA (Llama, Qwen2 with q/k/v biases), a sliding window
in the mask table (Mistral), eager attention with soft-capping and alternating sliding layers
(Gemma2), written-out attention on a Conv1D (GPT-2 eager), partial rotary (Phi), ALiBi added to
the scores (Bloom; Falcon with alibi=True), experts that sort a rank's tokens (Mixtral). At cp=2
only (`ONE_MESH`): interleaved rotary built with torch.stack (Cohere, GPT-J), StableLM's q/k layer
norm per head, MPT's ALiBi sliced from a max_seq_len table.
"""
from __future__ import annotations

import torch
from torch import nn

__all__ = ["CONTEXT_MODELS", "ONE_MESH", "build_context", "context_batch"]

_COMMON = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
               max_position_embeddings=64)
_NO_DROPOUT = dict(resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0)
CONTEXT_MODELS: dict[str, tuple[str, str, dict]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(num_key_value_heads=2)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(num_key_value_heads=2, sliding_window=4)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(num_key_value_heads=2)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(num_key_value_heads=2, head_dim=16, sliding_window=4,
                                                         attn_implementation="eager")),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(n_layer=2, n_head=4, n_embd=64, n_positions=64,
                                                  attn_implementation="eager")),
    "phi": ("PhiConfig", "PhiForCausalLM", dict(num_key_value_heads=4, partial_rotary_factor=0.5, **_NO_DROPOUT)),
    "bloom": ("BloomConfig", "BloomForCausalLM", dict(n_layer=2, n_head=4, hidden_dropout=0.0,
                                                      attention_dropout=0.0)),
    "falcon": ("FalconConfig", "FalconForCausalLM", dict(alibi=True, num_kv_heads=4, new_decoder_architecture=False,
                                                         multi_query=False, hidden_dropout=0.0,
                                                         attention_dropout=0.0)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_key_value_heads=2, num_local_experts=4,
                                                            num_experts_per_tok=2)),
    "cohere": ("CohereConfig", "CohereForCausalLM", dict(num_key_value_heads=2, pad_token_id=0)),
    "gptj": ("GPTJConfig", "GPTJForCausalLM", dict(n_layer=2, n_head=4, n_embd=64, n_positions=64, rotary_dim=8,
                                                   resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)),
    "stablelm": ("StableLmConfig", "StableLmForCausalLM", dict(num_key_value_heads=4, qk_layernorm=True)),
    "mpt": ("MptConfig", "MptForCausalLM", dict(d_model=64, n_layers=2, n_heads=4, max_seq_len=64,
                                                attn_config={"alibi": True})),
}
ONE_MESH = {"cohere", "gptj", "stablelm", "mpt"}      # forms checked at cp=2 alone (the suite's time)


def build_context(name: str, seed: int = 0, **overrides) -> nn.Module:
    import transformers as hf
    cfg_name, model_name, extra = CONTEXT_MODELS[name]
    kw = {**_COMMON, **extra, **overrides}
    attn = kw.pop("attn_implementation", None)
    cfg = getattr(hf, cfg_name)(**kw)
    if attn is not None:
        cfg._attn_implementation = attn
    torch.manual_seed(seed)
    return getattr(hf, model_name)(cfg).eval()


def context_batch(batch: int = 2, seq: int = 16, seed: int = 1) -> dict[str, torch.Tensor]:
    """Token ids with left padding on the second row and -100 labels (the padding and a prompt)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 128, (batch, seq), generator=g)
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[1 % batch, :3] = 0
    labels = ids.clone()
    labels[mask == 0] = -100
    labels[0, :5] = -100
    return dict(input_ids=ids, attention_mask=mask, labels=labels)
