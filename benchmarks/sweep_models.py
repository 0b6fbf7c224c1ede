"""The models the planner's sweeps measure (benchmarks/planner_sweep.py, graph_memory_sweep.py):
name -> (a seeded model in training mode, its sequence length, its vocabulary, the names of its
token and label inputs). Each is built the same on every rank; dropout is on where the model has it.

    gpt       our nanoGPT (hidden 256, 8 heads, 4 layers, sequence 128, dropout 0.1)
    gpt2      Hugging Face GPT-2 (hidden 160, 4 heads, 6 layers, sequence 96, dropout 0.1)
    llama     Hugging Face Llama (hidden 192, 6 / 2 heads, 6 layers, FFN 512, sequence 96)
    mixtral   Hugging Face Mixtral (hidden 128, 4 / 2 heads, 4 layers, 4 experts top-2, sequence 96)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from autoshard.models import GPT, GPTConfig

__all__ = ["SweepModel", "SWEEP_MODELS", "GPT_SHAPE"]

VOCAB = 512
GPT_SHAPE = dict(n_layer=4, n_head=8, n_embd=256, vocab_size=VOCAB, block_size=128)


@dataclass(frozen=True)
class SweepModel:
    build: Callable[[], nn.Module]
    seq: int
    tokens: str          # the token ids' argument
    labels: str          # the labels' argument

    def model(self) -> nn.Module:
        torch.manual_seed(0)
        return self.build().train()


def _gpt2() -> nn.Module:
    import transformers as hf
    return hf.GPT2LMHeadModel(hf.GPT2Config(n_layer=6, n_head=4, n_embd=160, vocab_size=VOCAB, n_positions=96,
                                            resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1,
                                            bos_token_id=0, eos_token_id=0))


def _llama() -> nn.Module:
    import transformers as hf
    return hf.LlamaForCausalLM(hf.LlamaConfig(num_hidden_layers=6, num_attention_heads=6, num_key_value_heads=2,
                                              hidden_size=192, intermediate_size=512, vocab_size=VOCAB,
                                              max_position_embeddings=96))


def _mixtral() -> nn.Module:
    import transformers as hf
    return hf.MixtralForCausalLM(hf.MixtralConfig(num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                                  hidden_size=128, intermediate_size=256, num_local_experts=4,
                                                  num_experts_per_tok=2, vocab_size=VOCAB, max_position_embeddings=96))


SWEEP_MODELS: dict[str, SweepModel] = {
    "gpt": SweepModel(lambda: GPT(GPTConfig(**GPT_SHAPE, dropout=0.1)), GPT_SHAPE["block_size"], "idx", "targets"),
    "gpt2": SweepModel(_gpt2, 96, "input_ids", "labels"),
    "llama": SweepModel(_llama, 96, "input_ids", "labels"),
    "mixtral": SweepModel(_mixtral, 96, "input_ids", "labels"),
}
