"""precision="fp8" on a GPU (`./run gpu-check fp8`): torch._scaled_mm on CUDA's FP8 tensor cores. The
tp=2 program (simulation: both ranks on one GPU) against the single-device FP8 one, and the GPU's
programs against the CPU's on the same model and batch. Skipped without a CUDA GPU that has FP8
tensor cores (compute capability 8.9 or later); tests/simulation/test_fp8.py checks the same
programs on the CPU.

Tolerance: the model in bf16 (CUDA's rowwise _scaled_mm returns bf16 only), so losses agree within
bf16's 1e-2, as tests/simulation/test_fp8.py's bf16 comparison says why; the GPU and the CPU sum the
float8 products in different orders (cuBLASLt's tiles against the CPU's loop), and those sums are
rounded to bf16 on both, which again stays within 1e-2."""
import copy

import pytest
import torch

from autoshard import autoshard
from tests.simulation.test_fp8 import BF16_LOSS_TOL, _llama

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                                reason="needs a CUDA GPU with FP8 tensor cores (compute capability 8.9+)")


def _loss(model, ids, **split) -> float:
    prog = autoshard(model, example_kwargs={"input_ids": ids, "labels": ids}, precision="fp8", **split)
    out = prog.simulate(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = prog.full_grads()
    assert all(g is None or torch.isfinite(g).all() for g in grads.values())
    return out.loss.float().item()


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_on_cuda_equals_one_device_and_the_cpu(recipe):
    model = _llama()                                   # bf16
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    on_gpu = lambda **split: _loss(copy.deepcopy(model).cuda(), ids.cuda(), fp8_recipe=recipe, **split)  # noqa: E731
    one, two = on_gpu(tp=1), on_gpu(tp=2)
    cpu = _loss(copy.deepcopy(model), ids, fp8_recipe=recipe, tp=1)
    assert abs(two - one) <= BF16_LOSS_TOL * abs(one), (one, two)
    assert abs(one - cpu) <= BF16_LOSS_TOL * abs(cpu), (one, cpu)
