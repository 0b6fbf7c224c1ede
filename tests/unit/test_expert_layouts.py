"""Experts stored one module each (published MoE checkpoints) read as the stacked tensors the model
trains: which experts, in which order, gate rows before up rows; counts that do not fit are named;
histc on integers runs on the CPU (the meta-device capture's branch)."""
import pytest
import torch

from autoshard.checkpoint.expert_layouts import legacy_name, read_legacy_experts
from autoshard.checkpoint.index import CheckpointError
from autoshard.passes.rewrite.retarget import histc_on_cpu

E, I, H = 4, 3, 2


def _mixtral_files() -> dict[str, torch.Tensor]:
    out = {"model.layers.0.block_sparse_moe.gate.weight": torch.randn(E, H)}
    for e in range(E):
        for w, shape in (("w1", (I, H)), ("w3", (I, H)), ("w2", (H, I))):
            out[f"model.layers.0.block_sparse_moe.experts.{e}.{w}.weight"] = torch.randn(shape)
    return out


def test_mixtral_layout_gives_this_ranks_experts_gate_then_up():
    files = _mixtral_files()
    stored = set(files)
    got = read_legacy_experts("model.layers.0.mlp.experts.gate_up_proj", [E, 2 * I, H], (2, 4), stored, files.__getitem__)
    key = "model.layers.0.block_sparse_moe.experts.{}.{}.weight"
    want = torch.stack([torch.cat([files[key.format(e, "w1")], files[key.format(e, "w3")]]) for e in (2, 3)])
    assert torch.equal(got, want)
    down = read_legacy_experts("model.layers.0.mlp.experts.down_proj", [E, H, I], (0, 4), stored, files.__getitem__)
    assert torch.equal(down[1], files[key.format(1, "w2")])
    assert legacy_name("model.layers.0.mlp.gate.weight", stored) == "model.layers.0.block_sparse_moe.gate.weight"
    assert legacy_name("model.layers.0.mlp.gate.weight", {"model.layers.0.mlp.gate.weight"}) is None
    assert read_legacy_experts("model.layers.0.mlp.experts.gate_up_proj", [E, 2 * I, H], (0, 4), {"x"}, files.__getitem__) is None


def test_expert_counts_that_do_not_fit_are_named():
    files = _mixtral_files()
    with pytest.raises(CheckpointError, match="gate_up_proj: the checkpoint has 4 experts under "
                                              "model.layers.0.block_sparse_moe.experts, the model 8"):
        read_legacy_experts("model.layers.0.mlp.experts.gate_up_proj", [8, 2 * I, H], (0, 8), set(files), files.__getitem__)
    with pytest.raises(CheckpointError, match="has 4 experts .*, the model 3"):
        read_legacy_experts("model.layers.0.mlp.experts.down_proj", [3, H, I], (0, 3), set(files), files.__getitem__)
    with pytest.raises(CheckpointError, match=r"come out \(4, 6, 2\), the model's tensor is \(4, 6, 5\)"):
        read_legacy_experts("model.layers.0.mlp.experts.gate_up_proj", [E, 2 * I, 5], (0, 4), set(files), files.__getitem__)


def test_histc_of_integers_on_the_cpu():
    ids = torch.tensor([0, 3, 3, 1, 3], dtype=torch.int32)
    with pytest.raises(NotImplementedError):
        torch.histc(ids, bins=4, min=0, max=3)
    counts = histc_on_cpu(ids, 4, 0, 3)
    assert counts.dtype == torch.int32 and counts.tolist() == [1, 1, 0, 3]
    assert torch.equal(histc_on_cpu(ids.float(), 4, 0, 3), torch.histc(ids.float(), 4, 0, 3))
