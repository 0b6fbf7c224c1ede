"""kernels/attention.py: the causal-mask check and the attention that dispatches on it."""
import pytest
import torch
import torch.nn.functional as F

from autoshard.kernels.attention import attention, is_causal_mask
from autoshard.testing.metrics import max_rel


def _causal(L, S, dtype=torch.bool):
    keep = torch.ones(L, S, dtype=torch.bool).tril()
    if dtype == torch.bool:
        return keep
    return torch.zeros(L, S, dtype=dtype).masked_fill(~keep, float("-inf"))


def test_is_causal_mask_accepts_only_the_lower_triangle():
    assert is_causal_mask(_causal(6, 6).expand(2, 1, 6, 6))
    assert is_causal_mask(_causal(4, 6))                              # top-left aligned, as SDPA's is_causal
    assert is_causal_mask(_causal(6, 6, torch.float32))
    lowest = torch.zeros(5, 5).masked_fill(~_causal(5, 5), torch.finfo(torch.float32).min)
    assert is_causal_mask(lowest)
    padded = _causal(6, 6).expand(2, 1, 6, 6).clone()
    padded[1, :, :, 0] = False                                        # a padded first token in sample 1
    assert not is_causal_mask(padded)
    window = _causal(6, 6) & ~torch.ones(6, 6, dtype=torch.bool).tril(-3)     # sliding window of 3
    assert not is_causal_mask(window)
    assert not is_causal_mask(torch.ones(6, 6, dtype=torch.bool))
    assert not is_causal_mask(_causal(6, 6, torch.float32).masked_fill(_causal(6, 6), -1.0))
    assert not is_causal_mask(_causal(6, 6).long())
    assert not is_causal_mask(torch.ones(6, dtype=torch.bool))


@pytest.mark.parametrize("repeat", [1, 4])
@pytest.mark.parametrize("causal_mask", [True, False])
def test_attention_matches_sdpa_with_the_mask(repeat, causal_mask):
    torch.manual_seed(0)
    q = torch.randn(2, 8, 16, 32, requires_grad=True)
    k = torch.randn(2, 8 // repeat, 16, 32, requires_grad=True)
    v = torch.randn(2, 8 // repeat, 16, 32, requires_grad=True)
    mask = _causal(16, 16).expand(2, 1, 16, 16).clone()
    if not causal_mask:
        mask[0, :, :, :3] = False
        mask[0, :, :3, 0] = True            # every row keeps a key
    # the repeated heads as Hugging Face's repeat_kv builds them
    k_rep = k[:, :, None].expand(2, 8 // repeat, repeat, 16, 32).reshape(2, 8, 16, 32)
    v_rep = v[:, :, None].expand(2, 8 // repeat, repeat, 16, 32).reshape(2, 8, 16, 32)
    want = F.scaled_dot_product_attention(q, k_rep, v_rep, attn_mask=mask, scale=0.2)
    want_grads = torch.autograd.grad(want.square().sum(), (q, k, v))
    got = attention(q, k, v, mask, is_causal_mask(mask), scale=0.2, repeat=repeat)
    got_grads = torch.autograd.grad(got.square().sum(), (q, k, v))
    assert max_rel(got, want) <= 1e-6
    for g, w in zip(got_grads, want_grads):
        assert max_rel(g, w) <= 1e-5


def test_a_causal_flag_for_another_shape_is_not_trusted():
    """The flag belongs to the mask it was computed from; a mask of other query/key lengths than
    q and k (broadcast over rows) takes the masked path."""
    q, k, v = torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
    row = torch.ones(1, 6, dtype=torch.bool)          # [1, 6]: keeps every key for every query
    assert max_rel(attention(q, k, v, row, True), F.scaled_dot_product_attention(q, k, v)) <= 1e-6
