"""Small configurations of the models autoshard is checked against, with dropout off by default.

Dropout draws different masks in a sharded program than in the single-device one, so equivalence
is checked with dropout disabled; `dropout=p` turns it on everywhere (for the RNG-region checks).
"""
from __future__ import annotations

import torch
from torch import nn

from autoshard.models import GPT, GPTConfig

__all__ = ["MODEL_NAMES", "MOE_NAMES", "build_model", "build_moe"]

MODEL_NAMES = ("nanogpt", "gpt2", "llama", "bert")
MOE_NAMES = ("mixtral", "qwen3_moe", "olmoe")
VOCAB = 128


def build_model(name: str, *, seed: int = 0, layers: int = 2, heads: int = 8, kv_heads: int = 2,
                hidden: int = 64, dropout: float = 0.0) -> nn.Module:
    """A seeded small model; `kv_heads` < `heads` gives Llama grouped-query attention; `dropout`
    is every dropout probability of the config."""
    torch.manual_seed(seed)
    if name in ("nanogpt", "nanogpt-manual"):      # -manual: attention written out, not SDPA
        return GPT(GPTConfig(n_layer=layers, n_head=heads, n_embd=hidden, vocab_size=VOCAB, block_size=64,
                             dropout=dropout, flash=name == "nanogpt"))
    import transformers as hf
    if name == "gpt2":
        cfg = hf.GPT2Config(n_layer=layers, n_head=heads, n_embd=hidden, vocab_size=VOCAB, n_positions=64,
                            resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout)
        return hf.GPT2LMHeadModel(cfg)
    if name == "llama":
        cfg = hf.LlamaConfig(num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                             hidden_size=hidden, intermediate_size=2 * hidden, vocab_size=VOCAB,
                             max_position_embeddings=64, attention_dropout=dropout)
        return hf.LlamaForCausalLM(cfg)
    if name == "bert":
        cfg = hf.BertConfig(num_hidden_layers=layers, num_attention_heads=heads, hidden_size=hidden,
                            intermediate_size=2 * hidden, vocab_size=VOCAB, max_position_embeddings=64,
                            hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)
        return hf.BertForMaskedLM(cfg)
    raise ValueError(f"unknown model {name!r}; choose from {MODEL_NAMES} or 'nanogpt-manual'")


def build_moe(name: str, *, seed: int = 0, layers: int = 2, experts: int = 4, top_k: int = 2,
              aux_loss: bool = False, device: str = "cpu") -> nn.Module:
    """A seeded small mixture-of-experts decoder from transformers (hidden 32, 4 heads / 2 kv);
    `aux_loss`: the model adds its load-balancing loss to `.loss` (output_router_logits);
    `device="meta"`: nothing allocated (checkpoint/materialize.py gives it values)."""
    with torch.device(device):
        return _build_moe(name, seed, layers, experts, top_k, aux_loss)


def _build_moe(name: str, seed: int, layers: int, experts: int, top_k: int, aux_loss: bool) -> nn.Module:
    import transformers as hf
    torch.manual_seed(seed)
    common = dict(num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, hidden_size=32,
                  vocab_size=VOCAB, max_position_embeddings=64, num_experts_per_tok=top_k,
                  output_router_logits=aux_loss)
    if name == "mixtral":
        return hf.MixtralForCausalLM(hf.MixtralConfig(intermediate_size=64, num_local_experts=experts, **common))
    if name == "qwen3_moe":
        return hf.Qwen3MoeForCausalLM(hf.Qwen3MoeConfig(intermediate_size=64, moe_intermediate_size=32,
                                                        num_experts=experts, head_dim=8, **common))
    if name == "olmoe":
        return hf.OlmoeForCausalLM(hf.OlmoeConfig(intermediate_size=64, num_experts=experts, **common))
    raise ValueError(f"unknown MoE model {name!r}; choose from {MOE_NAMES}")


def input_name(name: str) -> str:
    return "idx" if name.startswith("nanogpt") else "input_ids"


def label_name(name: str) -> str:
    return "targets" if name.startswith("nanogpt") else "labels"


def logits_of(out) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out[0]
