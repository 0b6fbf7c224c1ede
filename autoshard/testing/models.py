"""Small configurations of the models autoshard is checked against, with dropout off by default.

Dropout draws different masks in a sharded program than in the single-device one, so equivalence
is checked with dropout disabled; `dropout=p` turns it on everywhere (for the RNG-region checks).
"""
from __future__ import annotations

import torch
from torch import nn

from autoshard.models import GPT, GPTConfig

__all__ = ["MODEL_NAMES", "build_model"]

MODEL_NAMES = ("nanogpt", "gpt2", "llama", "bert")
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


def input_name(name: str) -> str:
    return "idx" if name.startswith("nanogpt") else "input_ids"


def label_name(name: str) -> str:
    return "targets" if name.startswith("nanogpt") else "labels"


def logits_of(out) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out[0]
