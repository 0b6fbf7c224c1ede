"""The 2025-2026 hybrids (issue 59), from small configs of the Hugging Face classes: every attention,
MLP and mixer projection split at tp=2, tp=4, pp=2 and tp=2 x pp=2, with a padding mask and -100
labels, against the single-device model (loss, logits, gradients). So far:
- LFM2's gated short convolution: in_proj (its B / C / x chunks), the depthwise conv1d and out_proj
  split by channel;
- a Mamba-2 hybrid (Bamba): in_proj (z, x, B, C, dt blocks), conv1d, the group-wise gated norm and
  out_proj split by heads and groups, the chunked scan run per head (4 groups: Megatron, too, needs
  the groups divisible by tp);
- a Mamba-1 hybrid with experts (Jamba): in_proj, conv1d, x_proj (row-parallel), dt_proj, out_proj;
  the router whole by design;
- BitNet: the sub-norms between projections as distributed norms;
- ModernBERT: its fused Wqkv viewed as [3, heads, hd] and unbound, split with the heads (local and
  global attention layers); the masked-LM head's dense transform whole by design;
- a gated delta rule linear attention (Qwen3-Next): in_proj_qkvz and in_proj_ba by key-head groups,
  the head-split q, k and v joined for the depthwise conv1d (its channels cut as the three pieces
  are), the chunked delta rule per value head, the gated norm over the flattened heads kept per head,
  out_proj row-parallel.
"""
import re

import pytest
import torch

from autoshard import autoshard
from tests.harness.one_device import split_and_match

hf = pytest.importorskip("transformers")

VOCAB = 128


def _lfm2():
    cfg = hf.Lfm2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, conv_bias=True,
                        layer_types=["conv", "full_attention", "conv", "full_attention"])
    return hf.Lfm2ForCausalLM(cfg)


def _bamba():
    cfg = hf.BambaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, mamba_n_heads=8, mamba_d_head=16,
                         mamba_n_groups=4, mamba_d_state=16, mamba_expand=2, mamba_chunk_size=8,
                         attn_layer_indices=[1, 3], max_position_embeddings=64)
    return hf.BambaForCausalLM(cfg)


def _jamba():
    cfg = hf.JambaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                         expert_layer_period=2, expert_layer_offset=1, attn_layer_period=2, attn_layer_offset=1,
                         mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=8, use_mamba_kernels=False,
                         max_position_embeddings=64)
    return hf.JambaForCausalLM(cfg)


def _bitnet():
    cfg = hf.BitNetConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return hf.BitNetForCausalLM(cfg)


def _modernbert():
    cfg = hf.ModernBertConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                              num_attention_heads=4, max_position_embeddings=64, global_attn_every_n_layers=2,
                              local_attention=8, pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1,
                              sep_token_id=2)
    return hf.ModernBertForMaskedLM(cfg)


def _qwen3_next():
    # one gated delta rule layer and one attention layer, each with experts; 4 key heads, 8 value heads
    cfg = hf.Qwen3NextConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=4,
                             linear_num_value_heads=8, linear_key_head_dim=16, linear_value_head_dim=16,
                             linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                             shared_expert_intermediate_size=32, layer_types=["linear_attention", "full_attention"],
                             max_position_embeddings=64)
    return hf.Qwen3NextForCausalLM(cfg)


HYBRIDS = {"Lfm2": _lfm2, "Bamba": _bamba, "Jamba": _jamba, "BitNet": _bitnet, "ModernBert": _modernbert,
           "Qwen3Next": _qwen3_next}
# kept whole by design, as parts of parameter names: a router (a top-k over its experts), a masked-LM
# head's dense transform before its norm, a shared expert's gate (one score per token: no features
# to divide)
BY_DESIGN = {"Jamba": {"feed_forward.router."}, "ModernBert": {"head.dense."}, "Qwen3Next": {"shared_expert_gate."}}
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
    prog = split_and_match(model, _inputs(), tp, pp)
    whole = BY_DESIGN.get(arch, set())
    assert all(f.by_design for f in prog.sharding.fallbacks), prog.sharding.fallbacks
    if tp > 1:          # every projection and convolution of a block (Mamba-1's A_log, [d_inner, state], may stay whole)
        for path, module in model.named_modules():
            if isinstance(module, (torch.nn.Linear, torch.nn.Conv1d)) and _BLOCK.search(path + ".") \
                    and not any(part in path + "." for part in whole):
                assert f"{path}.weight" in prog.sharding.params, f"{path} stays whole"


@pytest.mark.parametrize("arch", ["Lfm2", "Bamba"])
def test_context_parallelism_refuses_a_convolution_over_the_sequence_naming_the_layer(arch):
    """A causal conv at cp=2 needs the previous rank's last k - 1 tokens; before, the refusal said
    only that no rule covered conv1d."""
    from autoshard import ShardingError
    model = HYBRIDS[arch]()
    with pytest.raises(ShardingError, match=r"cp=2: node conv1d .* in model\.layers\.0\.\w+ .*a convolution over "
                                            r"the sequence \(kernel \d\) reads the tokens before each"):
        autoshard(model, cp=2, dp=2, example_kwargs=_inputs())


def test_mamba_groups_fewer_than_tp_stay_whole_saying_why():
    """2 groups at tp=4: B and C each held by 2 ranks, the heads split over 4; the mixer stays whole
    (as Megatron needs the groups divisible by tp). Before, the message said only "combines
    differently sharded operands"."""
    cfg = hf.BambaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, mamba_n_heads=8, mamba_d_head=16,
                         mamba_n_groups=2, mamba_d_state=16, mamba_expand=2, mamba_chunk_size=8,
                         attn_layer_indices=[1], max_position_embeddings=64)
    prog = autoshard(hf.BambaForCausalLM(cfg), tp=4, example_kwargs=_inputs())
    mixer, out_proj = [f for f in prog.sharding.fallbacks if not f.by_design]
    assert "model.layers.0.mamba.in_proj (Linear)" in mixer.modules, mixer
    assert re.search(r"combines differently sharded operands: one is held by 2 ranks at a time \(blocks fewer "
                     r"than tp=4, such as Mamba groups\), the other split over them; the blocks must divide by "
                     r"tp=4", mixer.reason), mixer.reason
    # out_proj (128 -> 64 features) is whole as a consequence; before, it was called "a low-rank
    # down-projection ... kept whole, as Megatron keeps these", by design
    assert out_proj.modules == ("model.layers.0.mamba.out_proj (Linear)",), out_proj
    assert "low-rank" not in out_proj.reason and "its input is whole because model.layers.0.mamba.in_proj (Linear) " \
        "stayed whole" in out_proj.reason, out_proj.reason

