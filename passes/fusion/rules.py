"""The fusion pass's rewrites as data: `RULES`, rows of (name, pattern, builder). A pattern says which
subgraph a fused op replaces; a builder inserts the replacement (see passes/fusion/fuse.py for how rows
are applied and what they must keep: values and dtypes of the code they replace)."""
from __future__ import annotations

import itertools
import math
import operator
from typing import Callable

import torch
import torch.fx as fx

from autoshard.passes.fusion.checks import (
    equals,
    is_causal_buffer,
    is_dim,
    is_dim_3,
    is_heads_unsqueezed_table,
    is_input_dtype,
    is_bias_of,
    is_int,
    is_last_dim,
    is_last_dim_only,
    is_like_input,
    is_neg_inf,
    is_no_draw_or_region,
    is_none,
    is_number,
    is_one_plus_weight,
    is_scores_length,
    is_shaped_like,
    is_slice_start,
    is_to_end,
    is_to_fp32,
    is_true,
    is_vector_param,
    is_weight_dtype,
    is_zero,
    keeps_bias_dim,
)
from autoshard.passes.fusion.pattern import P, V

__all__ = ["RULES", "Call"]

aten, fused = torch.ops.aten, torch.ops.autoshard


# ---- builders -----------------------------------------------------------------------------------------
# A builder gets `call` (passes/fusion/fuse.py's Inserter: `call(target, args, like=root)` inserts a node
# carrying `like`'s meta, `call.random(module_node, op, args)` a random op under module_node's RNG
# region), the bound values and the matched root.
Call = Callable[..., fx.Node]


def _layer_norm(call: Call, env: dict, root: fx.Node) -> fx.Node:
    n = call(fused.norm.default, (env["x"], env["w"], env["b"], float(env["eps"]), False))
    return call(operator.getitem, (n, 0))


def _take_bias_out(call: Call, env: dict) -> tuple[fx.Node, fx.Node]:
    """linear(x, w, b) -> linear(x, w), and b in that output's dtype: autocast's linear casts its
    bias with the weight, so the fused op must add the bias as the linear would have."""
    y = call(aten.linear.default, (env["x"], env["w"]), like=env["lin"])
    b = call(aten.type_as.default, (env["b"], y), like=env["lin"])
    b.meta.pop("val", None)                           # the linear's value, not the bias's
    return y, b


def _bias_gelu(call: Call, env: dict, root: fx.Node) -> fx.Node:
    x, b = _take_bias_out(call, env) if "lin" in env else (env["x"], env["b"])
    return call(fused.bias_gelu.default, (x, b, root.kwargs.get("approximate", "none")))


def _rms_norm(call: Call, env: dict, root: fx.Node) -> fx.Node:
    x = env["h"].args[0]                             # the norm's input before its cast to fp32
    n = call(fused.norm.default, (x, env["w"], None, float(env["eps"]), True))
    return call(operator.getitem, (n, 0))


def _rotary(call: Call, env: dict, root: fx.Node) -> fx.Node:
    cos, sin = env["cos"].args[0], env["sin"].args[0]      # the [b, s, d] tables, before unsqueeze(1)
    return _in_layout_of(call, call(fused.rotary.default, (env["x"], cos, sin, False, env["half"])), root)


def _in_layout_of(call: Call, out: fx.Node, root: fx.Node) -> fx.Node:
    """`out` (the fused op's contiguous result) laid out in memory as the eager `root`'s was. What
    reads it may depend on that: SDPA's output takes q's layout, and JetMoE views the attention's
    output transposed, as eager's layout allows (q [b, heads, s, d] there is a transpose of
    [b, s, heads, d], and so is the rotary's element-wise output). A dense copy in the root's dim
    order; nothing when the root was contiguous or its value is unknown."""
    val = call.captured(root)
    if not isinstance(val, torch.Tensor) or val.dim() < 2 or val.is_contiguous():
        return out
    order = sorted(range(val.dim()), key=lambda d: -val.stride(d))       # outermost dim first
    inverse = [order.index(d) for d in range(val.dim())]
    dense = call(aten.clone.default, (call(aten.permute.default, (out, order)),),
                 kwargs={"memory_format": torch.contiguous_format})
    return call(aten.permute.default, (dense, inverse))


def _gelu_tanh(call: Call, env: dict, root: fx.Node) -> fx.Node:
    return call(fused.bias_gelu.default, (env["x"], None, "tanh"))


def _swiglu(call: Call, env: dict, root: fx.Node) -> fx.Node:
    return call(fused.swiglu.default, (env["a"], env["u"], None, None))


def _bias_residual(call: Call, env: dict, root: fx.Node) -> fx.Node:
    y, b = _take_bias_out(call, env) if "lin" in env else (env["y"], env["b"])
    if "shape" in env:          # (y + b).view(shape) = y.reshape(shape) + b: the add's output was
        # contiguous, y need not be (a real reduce-scatter's output under sequence parallelism is not)
        y = call(aten.reshape.default, (y, env["shape"]))
    drop = env.get("drop")
    if drop is not None and drop.op == "call_module":     # dropout under its region's generator
        # the module draws the seed (its region's) and sets p to 0 in eval mode; 0 is a placeholder
        return call.random(drop, fused.bias_dropout_add.default, (y, b, env["res"], float(env["p"]), 0))
    return call(fused.bias_dropout_add.default, (y, b, env["res"], 0.0, 0))


def _causal_softmax(call: Call, env: dict, root: fx.Node) -> fx.Node:
    scale = env.get("scale", 1.0)
    if "divisor" in env:
        scale = 1.0 / env["divisor"]
    return call(fused.scaled_masked_softmax.default, (env["s"], None, float(scale), True))


def _gelu_ok(kw: dict) -> bool:
    return set(kw) <= {"approximate"}


_BIAS = V("b", is_vector_param)
_LINEAR_BIAS = P((aten.linear.default,), (V("x"), V("w"), _BIAS), bind="lin")
# The kernels read each operand either as the result's full shape or as a [cols] vector, nothing
# that broadcasts otherwise (kernels/dispatch.py falls back per call; these keep such operands out
# of the graph's fused ops in the first place). "sum" is the bias add, "out" the matched root.
_ADDED_BIAS = V("b", is_bias_of("sum"))


def _full(name: str, of: str) -> V:
    return V(name, is_shaped_like(of))


def _bias_add(operand: str) -> list[P]:
    """operand + b and b + operand, operand shaped like the sum, b a bias along its last dim."""
    return [P((aten.add.Tensor,), (_full(operand, "sum"), _ADDED_BIAS), bind="sum"),
            P((aten.add.Tensor,), (_ADDED_BIAS, _full(operand, "sum")), bind="sum")]


def _gelu_tanh_written_out() -> P:
    """0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x ** 3))), as Hugging Face's gelu_new
    (GPT-2) traces: the tanh form of aten.gelu spelled in eight element-wise ops."""
    mul, add, x = (aten.mul.Tensor,), (aten.add.Tensor,), V("x")
    cubic = P(add, (x, P(mul, (P((aten.pow.Tensor_Scalar,), (x, V("three", equals(3.0)))),
                               V("c", equals(0.044715))))))
    inner = P((aten.tanh.default,), (P(mul, (cubic, V("k", equals(math.sqrt(2 / math.pi))))),))
    return P(mul, (P(mul, (x, V("half", equals(0.5)))), P(add, (inner, V("one", equals(1.0))))))


def _rms_norm_patterns() -> list[P]:
    """h * rsqrt(mean(h ** 2, -1, keepdim) + eps), h = x.to(float32), then scaled as Hugging Face's
    norms trace: LlamaRMSNorm's weight * normed.to(dtype) (dtype: the input's at capture, which must
    be the weight's), GemmaRMSNorm's (normed * (1 + weight.float())).type_as(x), and Olmo2's (and
    T5's) (weight * normed).to(x's dtype)."""
    h = V("h", is_to_fp32)
    mean_sq = P((aten.mean.dim,), (P((aten.pow.Tensor_Scalar,), (h, V("two", equals(2.0)))), V("dims", is_last_dim),
                                   V("keep", is_true)))
    rstd = P((aten.rsqrt.default,), (P((aten.add.Tensor,), (mean_sq, V("eps", is_number))),))
    normed = P((aten.mul.Tensor,), (h, rstd))
    llama = P((aten.mul.Tensor,), (V("w", is_vector_param), P((aten.to.dtype,), (normed, V("dtype", is_weight_dtype)))))
    gemma = P((aten.type_as.default,), (P((aten.mul.Tensor,), (normed, V("w", is_one_plus_weight))),
                                        V("like", is_like_input)))
    olmo2 = P((aten.to.dtype,), (P((aten.mul.Tensor,), (V("w", is_vector_param), normed)), V("dtype", is_input_dtype)))
    return [llama, gemma, olmo2]


def _rotary_written_out() -> P:
    """x * cos.unsqueeze(1) + cat([-x[..., h:], x[..., :h]], -1) * sin.unsqueeze(1), as Hugging
    Face's apply_rotary_pos_emb traces for q and for k ([b, heads, s, d]; slices on dim 3, which
    the op checks is the last). The tables come from a no-grad block: the fused op owes them none."""
    x, half, dim = V("x"), V("half", is_int), V("dim", is_dim_3)
    upper = P((aten.slice.Tensor,), (x, dim, half, V("end", is_to_end)))
    lower = P((aten.slice.Tensor,), (x, dim, V("zero", is_zero), half))
    rotated = P((aten.cat.default,), ([P((aten.neg.default,), (upper,)), lower], V("cat_dim", is_dim_3)))
    return P((aten.add.Tensor,), (P((aten.mul.Tensor,), (x, V("cos", is_heads_unsqueezed_table))),
                                  P((aten.mul.Tensor,), (rotated, V("sin", is_heads_unsqueezed_table)))))


def _causal_softmax_patterns() -> list[P]:
    """softmax(scores [* scale | / d].masked_fill(buf[:, :, :T, :T] == 0, -inf), -1), as nanoGPT
    writes attention without SDPA: `buf` a causal [1, 1, n, n] buffer, T the scores' length."""
    s = V("s")
    scaled = [P((aten.mul.Tensor,), (s, V("scale", is_number))), P((aten.div.Tensor,), (s, V("divisor", is_number))), s]
    rows = P((aten.slice.Tensor,), (V("buf", is_causal_buffer), V("d2", is_dim(2)), V("start2", is_slice_start),
                                    V("T", is_scores_length)))
    mask = P((aten.eq.Scalar,), (P((aten.slice.Tensor,), (rows, V("d3", is_dim(3)), V("start3", is_slice_start), V("T"))),
                                 V("zero", is_zero)))
    return [P((aten.softmax.int,), (P((aten.masked_fill.Scalar,), (x, mask, V("ninf", is_neg_inf))),
                                    V("dim", is_dim_3), V("dtype", is_none, default=None)))
            for x in scaled]


def _residual_patterns() -> list[P]:
    """res + [dropout]([view](y + b)), both operand orders, and res + linear(x, w, b). The view is
    the one a 2-D GEMM's output takes back to [b, s, h] (GPT-2's Conv1D); it must keep the last
    dim, the bias's. The dropout is one of p = 0, or a training dropout, which the rewrite made a
    module running it under its RNG region's generator: the fused op's mask is then its own hash
    of a seed drawn from that generator (the same distribution, not torch's mask)."""
    biased = _bias_add("y")
    biased += [P((aten.view.default,), (b, V("shape", keeps_bias_dim))) for b in biased]
    dropped = [P((aten.dropout.default,), (b, V("p", is_no_draw_or_region), V("train", default=True)), bind="drop")
               for b in biased]
    inner = biased + dropped + [_LINEAR_BIAS]
    res = _full("res", "out")
    return [P((aten.add.Tensor,), (res, i) if first else (i, res), bind="out")
            for i, first in itertools.product(inner, (True, False))]


RULES: list[tuple[str, P, Callable]] = [
    ("layer_norm", P((aten.layer_norm.default,),
                     (V("x"), V("shape", is_last_dim_only), V("w", default=None), V("b", default=None),
                      V("eps", default=1e-5), V("cudnn_enable", default=True))), _layer_norm),
    ("bias_gelu", P((aten.gelu.default,), (_LINEAR_BIAS,), kwargs_ok=_gelu_ok), _bias_gelu),
    *(("bias_gelu", P((aten.gelu.default,), (add,), kwargs_ok=_gelu_ok), _bias_gelu) for add in _bias_add("x")),
    *(("rms_norm", p, _rms_norm) for p in _rms_norm_patterns()),
    ("gelu_tanh", _gelu_tanh_written_out(), _gelu_tanh),
    ("rotary", _rotary_written_out(), _rotary),
    ("swiglu", P((aten.mul.Tensor,), (P((aten.silu.default,), (_full("a", "out"),)), _full("u", "out")), bind="out"),
     _swiglu),
    ("swiglu", P((aten.mul.Tensor,), (_full("u", "out"), P((aten.silu.default,), (_full("a", "out"),))), bind="out"),
     _swiglu),
    *(("bias_residual", p, _bias_residual) for p in _residual_patterns()),
    *(("causal_softmax", p, _causal_softmax) for p in _causal_softmax_patterns()),
]
