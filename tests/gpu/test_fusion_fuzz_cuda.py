"""The fusion fuzz (tests/fusion_fuzz.py) on a GPU: random programs from the rules' patterns with
operands of every kind in every slot, fused with the CUDA kernels against the model, and direct
calls of the fused ops on random operand kinds. Skipped without a GPU; the CPU executor runs the
same in tests/simulation/test_fusion_fuzz.py."""
import pytest
import torch

from tests.fusion_fuzz import check_direct_calls, check_program

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_fused_random_programs_equal_the_model_on_cuda():
    fused = [check_program(seed, "cuda") for seed in range(240)]
    assert sum(f > 0 for f in fused) >= 80, fused


def test_fused_ops_on_operands_of_every_kind_on_cuda():
    assert check_direct_calls(400, "cuda") == 400
