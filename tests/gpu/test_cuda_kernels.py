"""The CUDA kernels on a GPU: every case against float64, forward and backward, and run to run.
Without a GPU these skip."""
import pytest
import torch

from autoshard.testing.kernel_accuracy import TOL, assert_within, errors_against_float64
from autoshard.testing.kernel_cases import CASES, make_inputs

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(CASES))
def test_cuda_kernels_match_float64_forward_and_backward(name, dtype):
    """Every kernel, forward and backward, every checked shape (single elements, tails, odd sizes),
    outputs poisoned: the kernels ran (launch counts) and wrote every element correctly."""
    from autoshard.kernels.launch import LAUNCHES
    case = CASES[name]
    for shape in case.shapes:
        before = sum(LAUNCHES.values())
        errs = errors_against_float64(case, shape, dtype, "cuda")
        assert sum(LAUNCHES.values()) - before >= 2, f"{name} {shape}: the kernels did not run (fallback)"
        assert_within(errs, TOL[dtype], f"{name} {shape} on CUDA")


@cuda
def test_cuda_kernels_are_deterministic_run_to_run():
    """A moving result on the same inputs means a race: run each case twice, forward and backward,
    bit-compare (the norms' weight gradients are per-block partials summed in a fixed order)."""
    for case in CASES.values():
        inputs = make_inputs(case, case.shapes[-1], torch.bfloat16, "cuda", 7)
        runs, grad = [], None
        for _ in range(2):
            out = case.fused(**inputs)
            grad = torch.randn_like(out) if grad is None else grad
            runs.append((out, *torch.autograd.grad(out, [inputs[k] for k in case.grads], grad)))
        assert all(torch.equal(a, b) for a, b in zip(*runs)), case.name
