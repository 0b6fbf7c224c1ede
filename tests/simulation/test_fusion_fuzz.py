"""Fuzz of the fusion rules and the kernels' slots, on the CPU executor (the CUDA sources, guard
pages around every tensor); tests/gpu/test_fusion_fuzz_cuda.py runs the same on a GPU:

- 240 random programs from the rules' patterns with broadcast, sliced, offset, transposed and
  scalar operands in every slot (tests/fusion_fuzz.py), fused, against the model: outputs and
  input and parameter gradients. Every op the pass fused must run its kernel (the rules let in only
  what the kernels read), and most programs fuse something.
- 400 direct calls of the fused ops with a random operand kind in every tensor slot: the torch
  implementation's result, whatever the kernel can or cannot read (kernels/dispatch.py decides per
  call). Dropping a slot check makes these fail (a read past a guard page, or a wrong value).
"""
import pytest

from autoshard.kernels import cpu_executor
from tests.fusion_fuzz import check_direct_calls, check_program

pytestmark = pytest.mark.skipif(cpu_executor.compiler() is None,
                                reason="no host C++ compiler (g++ or $CXX): the CPU executor cannot be built here")

PROGRAMS, BLOCK = 240, 40


@pytest.mark.parametrize("block", range(PROGRAMS // BLOCK))
def test_fused_random_programs_equal_the_model(block):
    with cpu_executor.enabled():
        fused = [check_program(seed) for seed in range(block * BLOCK, (block + 1) * BLOCK)]
    assert sum(f > 0 for f in fused) >= BLOCK // 3, fused      # most patterns fuse with full operands


def test_fused_ops_on_operands_of_every_kind_equal_their_torch_implementation():
    with cpu_executor.enabled():
        assert check_direct_calls(400, "cpu") == 400
