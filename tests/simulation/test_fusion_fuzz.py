"""Fuzz of the fusion rules and the kernels' slots, on the CPU executor (the CUDA sources, guard
pages around every tensor):

- 240 random programs from the rules' patterns with broadcast, sliced, offset, transposed and
  scalar operands in every slot (tests/fusion_fuzz.py), fused, against the model: outputs and
  input and parameter gradients. Every op the pass fused must run its kernel (the rules let in only
  what the kernels read), and most programs fuse something.
- 400 direct calls of the fused ops with a random operand kind in every tensor slot: the torch
  implementation's result, whatever the kernel can or cannot read (kernels/dispatch.py decides per
  call). Dropping a slot check makes these fail (a read past a guard page, or a wrong value).
"""
import random

import pytest
import torch

from autoshard import autoshard
from autoshard.kernels import cpu_executor, launch
from autoshard.kernels.reference import bias_dropout_add_fwd, bias_gelu_fwd, norm_fwd, swiglu_fwd
from autoshard.testing import fused_ops, grad_errors, max_rel
from autoshard.testing.metrics import norm_rel
from tests.fusion_fuzz import make_program

pytestmark = pytest.mark.skipif(cpu_executor.compiler() is None,
                                reason="no host C++ compiler (g++ or $CXX): the CPU executor cannot be built here")

PROGRAMS, BLOCK = 240, 40
# forward kernels by the rule that fuses them
_KERNEL_OF = {"bias_gelu": "bias_gelu_fwd", "gelu_tanh": "bias_gelu_fwd", "swiglu": "swiglu_fwd",
              "bias_residual": "bias_dropout_add_fwd", "layer_norm": "norm_fwd", "rms_norm": "norm_fwd"}


def check_program(seed: int, device: str = "cpu") -> int:
    """Seed's program fused against the model; returns how many ops were fused."""
    p = make_program(seed)
    model = p.model.to(device)
    x, x_ref = (p.x.to(device).requires_grad_(True) for _ in range(2))
    prog = autoshard(model, tp=1, example_inputs=(x,), fuse=True)
    fused = fused_ops(prog.rank(0).graph_module)
    before = launch.LAUNCHES.copy()
    got = prog.simulate(x)
    want = model(x_ref)
    assert max_rel(got, want) <= 1e-5, p.description
    grad = torch.randn(want.shape, generator=torch.Generator().manual_seed(seed)).to(device)
    got.backward(grad)
    want_grads = torch.autograd.grad(want, [x_ref, *model.parameters()], grad, allow_unused=True)
    assert max_rel(x.grad, want_grads[0]) <= 1e-5, p.description
    got_grads = prog.full_grads()
    want = {name: w for (name, _), w in zip(model.named_parameters(), want_grads[1:]) if w is not None}
    assert {n for n, g in got_grads.items() if g is not None and g.abs().any()} <= set(want), p.description
    # All gradients together norm-wise at 1e-5; per tensor against the project's floor at 1e-3: a
    # gradient zero in exact arithmetic (a shift of whole rows before a norm) is rounding noise
    # summed over every element (seen: 2.4e-4 of the floor), while a slot read wrongly is off by O(1).
    assert norm_rel({n: got_grads[n] for n in want}, want) <= 1e-5, p.description
    errs = grad_errors(got_grads, want)
    assert max(errs.values()) <= 1e-3, (p.description, errs)
    ran = launch.LAUNCHES - before
    for rule in fused:
        assert ran[_KERNEL_OF[rule]] >= 1, f"{p.description}: {rule} was fused but its kernel did not run ({dict(ran)})"
    return len(fused)


@pytest.mark.parametrize("block", range(PROGRAMS // BLOCK))
def test_fused_random_programs_equal_the_model(block):
    with cpu_executor.enabled():
        fused = [check_program(seed) for seed in range(block * BLOCK, (block + 1) * BLOCK)]
    assert sum(f > 0 for f in fused) >= BLOCK // 3, fused      # most patterns fuse with full operands


# ---- direct calls: every tensor slot with a random operand kind ----------------------------------------
def _operand(kind: str, rows: int, cols: int, gen: torch.Generator) -> torch.Tensor:
    def r(*shape):
        return torch.randn(shape, generator=gen)
    return {"full": lambda: r(rows, cols), "vector": lambda: r(cols), "one": lambda: r(1),
            "column": lambda: r(rows, 1), "scalar": lambda: r(1).reshape(()),
            "transposed": lambda: r(cols, rows).t(), "sliced": lambda: r(rows, 2 * cols)[:, :cols],
            "offset": lambda: r(rows * cols + 1)[1:].view(rows, cols),
            "broadcast": lambda: r(cols).expand(rows, cols), "empty": lambda: r(0, cols)}[kind]()


_KINDS = ("full", "vector", "one", "column", "scalar", "transposed", "sliced", "offset", "broadcast", "empty")
# op -> (number of tensor slots, the op, its exact torch implementation)
_OPS = {
    "bias_gelu": (2, lambda a, b: torch.ops.autoshard.bias_gelu(a, b, "tanh"), lambda a, b: bias_gelu_fwd(a, b, True)),
    "swiglu": (3, lambda a, u, b: torch.ops.autoshard.swiglu(a, u, b, None), lambda a, u, b: swiglu_fwd(a, u, b, None)),
    "bias_dropout_add": (3, lambda x, b, r: torch.ops.autoshard.bias_dropout_add(x, b, r, 0.0, 0),
                         lambda x, b, r: bias_dropout_add_fwd(x, b, r, 0.0, 0)),
    "norm": (3, lambda x, w, b: torch.ops.autoshard.norm(x, w, b, 1e-5, False)[0],
             lambda x, w, b: norm_fwd(x, w, b, 1e-5, False)[0]),
}


def _broadcastable(*ts: torch.Tensor) -> bool:
    try:
        torch.broadcast_shapes(*(t.shape for t in ts))
        return True
    except RuntimeError:
        return False


def test_fused_ops_on_operands_of_every_kind_equal_their_torch_implementation():
    rng, gen = random.Random(0), torch.Generator().manual_seed(0)
    calls = 0
    with cpu_executor.enabled():
        while calls < 400:
            name = rng.choice(sorted(_OPS))
            slots, op, ref = _OPS[name]
            rows, cols = rng.choice((1, 3, 6)), rng.choice((8, 12, 40))
            args = [_operand(rng.choice(_KINDS), rows, cols, gen) for _ in range(slots)]
            if name == "norm" and (args[0].dim() == 0 or any(a.dim() != 1 or a.shape[0] != args[0].shape[-1]
                                                             for a in args[1:])):
                continue                         # norm's weight and bias must be [features]: its API says so
            if name != "norm" and not _broadcastable(*args):
                continue
            got, want = op(*args), ref(*args)
            assert got.shape == want.shape and torch.allclose(got, want, atol=1e-5, rtol=1e-5), (
                name, [(tuple(a.shape), a.stride()) for a in args])
            calls += 1
