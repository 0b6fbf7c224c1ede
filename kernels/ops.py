"""The fused ops: the table of them, and the functions users call.

    from autoshard.kernels import ops
    y = ops.bias_gelu(x, b)                        # gelu(x + b), tanh form
    y = torch.ops.autoshard.bias_gelu(x, b, "none")   # the erf form, as the registered op

Each op is a torch custom op (namespace `autoshard`), so graphs, autograd and torch.compile see
ordinary ops, defined in its own module of kernels/fused/ with everything about it: its exact torch
implementation (what runs on every device, and what the kernel is checked against), the launch of
its CUDA kernel (kernels/cuda/, through CuPy on torch's current stream, tensors as device pointers,
no copies; on the CPU through the CPU executor), a fake implementation for tracing, autograd whose
backward is again a custom op, and its entry (`OP`): the kernel source and which calls run the
kernel (kernels/dispatch.py). Adding an op is its .cu file, its module, a line in `FUSED` below and
its pattern in passes/fusion/rules.py (with a case in autoshard/testing/kernel_cases.py).

Element-wise ops (bias + GeLU, SwiGLU, bias + dropout + residual) return the dtype torch's type
promotion gives the expression they replace (`x + bias` with a bf16 x and an fp32 bias is fp32), so
a fused graph keeps the unfused one's dtypes. Row-wise ops (scaled masked softmax, LayerNorm /
RMSNorm, rotary embedding): the norm returns its input's dtype, softmax too; rotary promotes like
the `x * cos` it replaces. Every output (backward's too) is contiguous whatever the inputs' strides,
as the CUDA kernels write them and the fake implementations declare them: torch.compile plans with
the fakes' strides, so they must be true. The ops broadcast inputs as the unfused torch code does.
"""
from __future__ import annotations

from autoshard.kernels.dispatch import FusedOp, Kernel, register
from autoshard.kernels.fused import bias_dropout_add as _bias_dropout_add
from autoshard.kernels.fused import bias_gelu as _bias_gelu
from autoshard.kernels.fused import norm as _norm
from autoshard.kernels.fused import rotary as _rotary
from autoshard.kernels.fused import softmax as _softmax
from autoshard.kernels.fused import swiglu as _swiglu

__all__ = ["FUSED", "KERNELS", "bias_gelu", "swiglu", "scaled_masked_softmax", "bias_dropout_add", "layer_norm",
           "rms_norm", "rotary", "draw_seed"]

FUSED: tuple[FusedOp, ...] = (_bias_gelu.OP, _swiglu.OP, _bias_dropout_add.OP, _softmax.OP, _norm.OP, _rotary.OP)
KERNELS: dict[str, Kernel] = {name: k for op in FUSED for name, k in op.kernels.items()}     # custom op name -> Kernel

for _op in FUSED:
    register(_op)

bias_gelu = _bias_gelu.bias_gelu
swiglu = _swiglu.swiglu
bias_dropout_add, draw_seed = _bias_dropout_add.bias_dropout_add, _bias_dropout_add.draw_seed
scaled_masked_softmax = _softmax.scaled_masked_softmax
layer_norm, rms_norm = _norm.layer_norm, _norm.rms_norm
rotary = _rotary.rotary
