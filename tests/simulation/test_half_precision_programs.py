"""Models cast to bf16 or fp16 before compiling: every pass works in the cast dtype (sequence
parallelism, recomputation, fused ops) and the tp=2 program matches the single-device half-precision
model within that dtype's rounding; recomputation stays bit for bit."""
import pytest
import torch

from autoshard import autoshard
from autoshard.testing.metrics import max_rel
from autoshard.testing.models import build_model

# relative gradient error (norm-wise per tensor): bf16 keeps 8 significant bits, fp16 11; the tp=2
# program sums its partial products in another order, so its roundings differ (measured 1.1e-2 and 1.7e-3)
GRAD_TOL = {torch.bfloat16: 3e-2, torch.float16: 5e-3}
OPTIONS = {"sp": dict(sequence_parallel=True), "full": dict(recompute="full"),
           "selective": dict(recompute="selective"), "fuse": dict(fuse=True), "cp": dict(cp=2)}


def _run(prog, ids):
    out = prog.simulate(input_ids=ids, labels=ids)
    out.loss.backward()
    return out.loss.detach(), prog.full_grads()


@pytest.mark.parametrize("option", sorted(OPTIONS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_half_precision_program_matches_the_half_precision_model(name, dtype, option):
    model = build_model(name, layers=2).to(dtype)
    ids = torch.randint(0, 128, (2, 16))
    loss, grads = _run(autoshard(model, tp=2, example_kwargs={"input_ids": ids, "labels": ids}, **OPTIONS[option]), ids)
    assert loss.dtype == torch.float32            # Hugging Face's loss upcasts the logits; the program keeps it
    ref = model(input_ids=ids, labels=ids).loss
    ref.backward()
    assert max_rel(loss, ref.float()) < 1e-4
    for k, p in model.named_parameters():
        g, r = grads[k].float(), p.grad.float()
        assert grads[k].dtype == dtype                # gradients in the cast dtype, as the model's
        assert (g - r).norm() <= GRAD_TOL[dtype] * r.norm() + 1e-6, k
    if option in ("full", "selective"):           # recomputation changes memory, never numbers
        plain_loss, plain_grads = _run(autoshard(model, tp=2, example_kwargs={"input_ids": ids, "labels": ids}), ids)
        assert torch.equal(plain_loss, loss) and all(torch.equal(plain_grads[k], grads[k]) for k in grads)
