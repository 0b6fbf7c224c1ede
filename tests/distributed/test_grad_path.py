"""The one gradient path on gloo processes (tests/harness/grad_path_check.py), against one device:
frozen parameters (an embedding, tied across stages at pp2; a whole layer; LoRA adapters on a frozen
base) stay bit-identical and the rest train as on one device, with AdamW and DistributedOptimizer;
two train_step calls before a step equal two backward passes on one device (SGD, both optimizers).
Before: at dp2 AdamW decayed a frozen embedding (1.4e-3 drift), DistributedOptimizer refused
frozen parameters, and accumulated steps were 0.5-0.8 off."""
import pytest

from autoshard.testing.launch import torchrun_lines
from tests.harness.grad_path_check import CASES, write_references

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("world,meshes", [(2, ["dp2", "pp2"]), (4, ["tp2dp2", "dp2pp2"])])
def test_frozen_parameters_and_accumulation_equal_one_device(tmp_path, world, meshes):
    refs = tmp_path / "references.pt"
    write_references(str(refs), meshes)
    lines = torchrun_lines("tests.harness.grad_path_check", ["--meshes", *meshes, "--reference", str(refs)], world)
    assert [(r["mesh"], r["case"], r["optim"]) for r in lines] == [(m, how, o) for m in meshes for how, o in CASES]
    for r in lines:
        assert r["all_ranks_ok"] and r["frozen_identical"], r
    assert any(r["frozen_here"] for r in lines)
