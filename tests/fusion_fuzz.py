"""Random small programs built from the fusion rules' patterns (passes/fusion/rules.py), each slot
filled with an operand of a random kind: the full activation, a [cols] or [1] parameter, a column
[.., 1], a [T, C] table that broadcasts over the batch, a transposed or sliced activation, a Python
scalar or a 0-dim parameter; and the checks tests/simulation/test_fusion_fuzz.py (the CPU executor)
and tests/gpu/test_fusion_fuzz_cuda.py (CUDA) run with them.

    program = make_program(seed)       # .model (an nn.Module), .x (its input), .description
    check_program(seed, "cuda")        # fused against the model: outputs, gradients, kernels ran
    check_direct_calls(400, "cuda")    # the fused ops on random operand kinds against torch
"""
from __future__ import annotations

import random
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from autoshard import autoshard
from autoshard.kernels import launch
from autoshard.kernels.fused.bias_dropout_add import bias_dropout_add_fwd
from autoshard.kernels.fused.bias_gelu import bias_gelu_fwd
from autoshard.kernels.fused.norm import norm_fwd
from autoshard.kernels.fused.swiglu import swiglu_fwd
from autoshard.testing import fused_ops, grad_errors, max_rel
from autoshard.testing.metrics import norm_rel

__all__ = ["Program", "make_program", "check_program", "check_direct_calls", "OPERANDS", "PATTERNS"]

OPERANDS = ("full", "full", "full", "vector", "one", "column", "table", "transposed", "sliced", "offset",
            "scalar", "scalar_param")
PATTERNS = ("bias_gelu", "gelu_linear", "swiglu", "bias_residual", "bias_dropout_residual", "linear_residual",
            "layer_norm", "rms_norm")


class _Operand(nn.Module):
    """One operand of kind `kind` for activations x [B, T, C]: computed from x, so gradients reach
    it, or a parameter."""

    def __init__(self, kind: str, b: int, t: int, c: int, gen: torch.Generator):
        super().__init__()
        self.kind = kind
        if kind in ("full", "column"):
            self.proj = nn.Linear(c, c)
        elif kind == "transposed":
            self.proj = nn.Linear(t, t)                # applied to x^T: [B, C, T] -> transposed back
        elif kind in ("sliced", "offset"):
            self.proj = nn.Linear(c, 2 * c)            # [.., 2C]: a half of it has rows of stride 2C
        shape = {"vector": (c,), "one": (1,), "table": (t, c), "scalar_param": ()}.get(kind)
        if shape is not None:
            self.weight = nn.Parameter(torch.randn(shape, generator=gen))

    def forward(self, x: torch.Tensor) -> torch.Tensor | float:
        c = x.shape[-1]
        if self.kind == "full":
            return self.proj(x)
        if self.kind == "column":
            return self.proj(x)[..., :1]                                      # (B, T, 1)
        if self.kind == "transposed":
            return self.proj(x.transpose(1, 2)).transpose(1, 2)               # (B, T, C), strides (T*C, 1, T)
        if self.kind == "sliced":
            return self.proj(x)[..., :c]                                      # (B, T, C), row stride 2C
        if self.kind == "offset":
            return self.proj(x)[..., c:]                                      # (B, T, C), starts C elements in
        if self.kind == "scalar":
            return 0.75
        return self.weight


class _Fuzzed(nn.Module):
    def __init__(self, pattern: str, kinds: list[str], b: int, t: int, c: int, gen: torch.Generator,
                 approximate: str):
        super().__init__()
        self.pattern, self.approximate = pattern, approximate
        self.inp = nn.Linear(c, c)
        self.lin = nn.Linear(c, c)
        self.ops = nn.ModuleList(_Operand(k, b, t, c, gen) for k in kinds)
        self.norm_weight = nn.Parameter(1 + 0.1 * torch.randn(c, generator=gen))
        self.norm_bias = nn.Parameter(0.1 * torch.randn(c, generator=gen))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        a, b = (op(h) for op in self.ops)
        if self.pattern == "bias_gelu":
            out = F.gelu(a + b, approximate=self.approximate)
        elif self.pattern == "gelu_linear":
            out = F.gelu(self.lin(h), approximate=self.approximate) * 1.0 + a
        elif self.pattern == "swiglu":
            out = F.silu(a) * b
        elif self.pattern == "bias_residual":
            out = a + (h + b)
        elif self.pattern == "bias_dropout_residual":
            out = a + F.dropout(b + h, p=0.0, training=self.training)
        elif self.pattern == "linear_residual":
            out = a + self.lin(h) + b
        elif self.pattern == "layer_norm":
            out = F.layer_norm(a + h, (h.shape[-1],), self.norm_weight, self.norm_bias) + b
        else:                                                                 # Llama's RMSNorm, as HF writes it
            v = (a + h).to(torch.float32)
            v = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-6)
            out = self.norm_weight * v.to(h.dtype) + b
        return out + h                  # every program depends on x, whatever its operands


@dataclass
class Program:
    model: nn.Module
    x: torch.Tensor
    description: str


def make_program(seed: int) -> Program:
    """The seed's program: a pattern, an operand kind per slot, sizes (C with and without a tail of
    16-byte packs), the GeLU form."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    pattern = rng.choice(PATTERNS)
    kinds = [rng.choice(OPERANDS), rng.choice(OPERANDS)]
    if pattern in ("swiglu", "layer_norm", "rms_norm") and kinds[0] == "scalar":
        kinds[0] = "scalar_param"       # silu(0.75), a norm of (0.75 + h): a tensor op of a float fails in torch
    b, t, c = rng.choice((1, 2)), rng.choice((3, 5)), rng.choice((8, 12, 40))
    approximate = rng.choice(("tanh", "none"))
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = _Fuzzed(pattern, kinds, b, t, c, gen, approximate)
    x = torch.randn(b, t, c, generator=gen)
    return Program(model, x, f"seed {seed}: {pattern}({', '.join(kinds)}) on [{b}, {t}, {c}], gelu {approximate}")


# ---- checks -------------------------------------------------------------------------------------------
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


# ---- direct calls: every tensor slot with a random operand kind ----------------------------------------
def _operand(kind: str, rows: int, cols: int, gen: torch.Generator, device: str) -> torch.Tensor:
    def r(*shape):
        return torch.randn(shape, generator=gen).to(device)
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


def check_direct_calls(n: int, device: str) -> int:
    """n calls of the fused ops (torch.ops.autoshard.*) with a random operand kind in every tensor
    slot against their torch implementations on `device`; returns how many were checked."""
    rng, gen = random.Random(0), torch.Generator().manual_seed(0)
    calls = 0
    while calls < n:
        name = rng.choice(sorted(_OPS))
        slots, op, ref = _OPS[name]
        rows, cols = rng.choice((1, 3, 6)), rng.choice((8, 12, 40))
        args = [_operand(rng.choice(_KINDS), rows, cols, gen, device) for _ in range(slots)]
        if name == "norm" and (args[0].dim() == 0 or any(a.dim() != 1 or a.shape[0] != args[0].shape[-1]
                                                         for a in args[1:])):
            continue                         # norm's weight and bias must be [features]: its API says so
        if name != "norm" and not _broadcastable(*args):
            continue
        got, want = op(*args), ref(*args)
        assert got.shape == want.shape and torch.allclose(got, want, atol=1e-5, rtol=1e-5), (
            name, [(tuple(a.shape), a.stride()) for a in args])
        calls += 1
    return calls
