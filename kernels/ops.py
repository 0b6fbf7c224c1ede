"""The fused ops as torch custom ops (namespace `autoshard`), so graphs, autograd and torch.compile
see ordinary ops. Each has an exact torch implementation (kernels/reference.py) that runs on every
device, a CUDA implementation launching the CuPy kernel of kernels/cuda/ on torch's current stream
(tensors cross as device pointers, no copies), a fake implementation for tracing, and autograd whose
backward is again a custom op. The element-wise ops live in `elementwise_ops.py`, the row-wise ones
(softmax, norms, rotary) in `row_ops.py`; this module is their public face.

    from autoshard.kernels import ops
    y = ops.bias_gelu(x, b)                        # gelu(x + b), tanh form
    y = torch.ops.autoshard.bias_gelu(x, b, "none")   # the erf form, as the registered op
"""
from __future__ import annotations

from autoshard.kernels.elementwise_ops import bias_dropout_add, bias_gelu, draw_seed, swiglu
from autoshard.kernels.row_ops import layer_norm, rms_norm, rotary, scaled_masked_softmax

__all__ = ["bias_gelu", "swiglu", "scaled_masked_softmax", "bias_dropout_add", "layer_norm", "rms_norm",
           "rotary", "draw_seed"]
