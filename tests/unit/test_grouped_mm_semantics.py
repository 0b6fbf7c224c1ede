"""The semantics passes/sharding/rules_experts.py gives transformers::grouped_mm_fallback: per
expert e, rows offs[e-1]:offs[e] of the output are x[those rows] @ W[e]; so splitting W's output
features gives column slices of the output, and splitting its input features (with x's) gives
partial sums whose total is the output."""
import pytest
import torch


@pytest.fixture
def grouped_mm():
    pytest.importorskip("transformers.integrations.moe")
    return torch.ops.transformers.grouped_mm_fallback


def _case():
    torch.manual_seed(0)
    x, w = torch.randn(10, 12), torch.randn(3, 12, 8)           # 10 tokens sorted by expert, 3 experts
    offs = torch.tensor([4, 4, 10], dtype=torch.int32)          # expert 1 gets no token
    return x, w, offs


def test_grouped_mm_is_a_matmul_per_expert_group(grouped_mm):
    x, w, offs = _case()
    want = torch.cat([x[0:4] @ w[0], x[4:10] @ w[2]])
    assert torch.allclose(grouped_mm(x, w, offs), want, atol=1e-6)


def test_grouped_mm_splits_like_a_linear_layer(grouped_mm):
    x, w, offs = _case()
    full = grouped_mm(x, w, offs)
    cols = [grouped_mm(x, w[:, :, c:c + 4], offs) for c in (0, 4)]            # column-parallel
    assert torch.allclose(torch.cat(cols, dim=1), full, atol=1e-6)
    rows = [grouped_mm(x[:, r:r + 6], w[:, r:r + 6, :], offs) for r in (0, 6)]  # row-parallel: partial sums
    assert torch.allclose(rows[0] + rows[1], full, atol=1e-5)


def test_gathered_linear_is_hf_batched_linear_and_splits_like_a_linear_layer():
    """kernels/expert_matmul_ops.py's gathered_linear (what passes/expert_matmuls.py puts in place of HF's
    batched_mm experts) against transformers' own `_batched_linear` on the stored [experts, out, in]
    weight, and its column / row split."""
    moe = pytest.importorskip("transformers.integrations.moe")
    from autoshard.kernels.expert_matmul_ops import gathered_linear
    torch.manual_seed(0)
    x, w, ids = torch.randn(10, 12), torch.randn(3, 8, 12), torch.tensor([2, 0, 0, 1, 2, 2, 1, 0, 2, 1])
    full = gathered_linear(x, w.transpose(-2, -1), ids)
    assert torch.allclose(full, moe._batched_linear(x, w[ids]), atol=1e-6)
    assert torch.allclose(full[3], x[3] @ w[1].T, atol=1e-6)
    cols = [gathered_linear(x, w[:, c:c + 4].transpose(-2, -1), ids) for c in (0, 4)]
    assert torch.allclose(torch.cat(cols, dim=1), full, atol=1e-6)
    rows = [gathered_linear(x[:, r:r + 6], w[:, :, r:r + 6].transpose(-2, -1), ids) for r in (0, 6)]
    assert torch.allclose(rows[0] + rows[1], full, atol=1e-5)
