"""Random small programs built from the fusion rules' patterns (passes/fusion/rules.py), each slot
filled with an operand of a random kind: the full activation, a [cols] or [1] parameter, a column
[.., 1], a [T, C] table that broadcasts over the batch, a transposed or sliced activation, a Python
scalar or a 0-dim parameter. Used by tests/simulation/test_fusion_fuzz.py (the CPU executor) and
tests/gpu/ (CUDA): fused against the model, outputs and gradients.

    program = make_program(seed)       # .model (an nn.Module), .x (its input), .description
"""
from __future__ import annotations

import random
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Program", "make_program", "OPERANDS", "PATTERNS"]

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
