"""The CUDA kernels on a GPU: every case against float64, forward and backward, and run to run.
Without a GPU these skip (tests/unit/test_cpu_executor.py runs the same checks on the CPU)."""
import pytest
import torch

from tests.harness.kernel_accuracy import check_deterministic, check_kernel_case
from autoshard.testing.kernel_cases import CASES

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(CASES))
def test_cuda_kernels_match_float64_forward_and_backward(name, dtype):
    """Every kernel, forward and backward, every checked shape (single elements, tails, odd sizes),
    outputs poisoned: the kernels ran (launch counts) and wrote every element correctly."""
    check_kernel_case(name, dtype, "cuda", "CUDA")


@cuda
def test_cuda_kernels_are_deterministic_run_to_run():
    check_deterministic("cuda")
