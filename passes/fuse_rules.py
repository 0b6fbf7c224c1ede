"""The fusion pass's rewrites as data: `RULES`, rows of (name, pattern, builder). A pattern says which
subgraph a fused op replaces; a builder inserts the replacement (see passes/fuse.py for how rows
are applied and what they must keep: values and dtypes of the code they replace)."""
from __future__ import annotations

import itertools
import math
import operator
from typing import Callable

import torch
import torch.fx as fx

from .pattern import P, Test, V

__all__ = ["RULES", "Call"]

aten, fused = torch.ops.aten, torch.ops.autoshard


# ---- tests on bound values -------------------------------------------------------------------------
def _vector(v, lookup) -> torch.Tensor | None:
    """The 1-D parameter or buffer (a bias) node `v` reads, directly or through f (identity
    forward, as sequence parallelism reads a bias: its gradient is summed over the sequence
    shards); else None."""
    if isinstance(v, fx.Node) and v.op == "call_module" and v.target == "f" and len(v.args) == 1:
        v = v.args[0]
    if not (isinstance(v, fx.Node) and v.op == "get_attr"):
        return None
    t = lookup(v.target)
    return t if isinstance(t, torch.Tensor) and t.dim() == 1 else None


def _vector_param(v, lookup, env) -> bool:
    return _vector(v, lookup) is not None


def _last_dim_only(v, lookup, env) -> bool:
    return isinstance(v, (list, tuple)) and len(v) == 1


def _zero(v, lookup, env) -> bool:
    return v == 0


def _const(c: float) -> Test:
    """A Python number equal to `c` to fp32 precision (traced constants such as sqrt(2 / pi))."""
    return lambda v, lookup, env: isinstance(v, (int, float)) and abs(v - c) <= 1e-6 * abs(c)


def _number(v, lookup, env) -> bool:
    return isinstance(v, (int, float))


def _last_dim(v, lookup, env) -> bool:
    return isinstance(v, (list, tuple)) and list(v) == [-1]


def _true(v, lookup, env) -> bool:
    return v is True


def _keeps_bias_dim(v, lookup, env) -> bool:
    """A view's shape whose last dim is the bias's length (so the bias can be added after it)."""
    return isinstance(v, (list, tuple)) and v[-1] == _vector(env["b"], lookup).shape[0]


def _no_grad_table(v: object) -> bool:
    """An output of a block traced under torch.no_grad (how Hugging Face builds its rotary cos and
    sin tables), so no gradient is owed to it."""
    if not (isinstance(v, fx.Node) and v.op == "call_function" and v.target is operator.getitem):
        return False
    block = v.args[0]
    return (isinstance(block, fx.Node) and getattr(block.target, "__name__", "") == "wrap_with_set_grad_enabled"
            and block.args[0] is False)


def _heads_unsqueezed_table(v, lookup, env) -> bool:
    """table.unsqueeze(1), [b, s, d] -> [b, 1, s, d], of a no-grad rotary table."""
    return (isinstance(v, fx.Node) and v.op == "call_function" and v.target == aten.unsqueeze.default
            and v.args[1] == 1 and _no_grad_table(v.args[0]))


def _dim_3(v, lookup, env) -> bool:
    """The last dim of a [b, heads, s, d] tensor (the fused op refuses any other rank)."""
    return v in (3, -1)


def _int(v, lookup, env) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _to_end(v, lookup, env) -> bool:
    return isinstance(v, int) and v >= 2**62             # slice to the end, as export writes x[..., h:]


def _to_fp32(v, lookup, env) -> bool:
    """A node `x.to(torch.float32)` (nothing else in the call)."""
    return (isinstance(v, fx.Node) and v.op == "call_function" and v.target == aten.to.dtype and not v.kwargs
            and len(v.args) == 2 and v.args[1] == torch.float32)


def _weight_dtype(v, lookup, env) -> bool:
    """The dtype a written-out norm casts back to is its weight's, so weight * y.to(dtype) has the
    dtype the fused norm returns (the input's: export asserts it is the captured one)."""
    return isinstance(v, torch.dtype) and _vector(env["w"], lookup).dtype == v


def _one_plus_weight(v, lookup, env) -> bool:
    """1 + w[.float()], w a 1-D parameter (Gemma's RMSNorm scales by one plus its weight): a node the
    fusion keeps as the fused norm's weight, so the weight's gradient still flows through it."""
    if not (isinstance(v, fx.Node) and v.op == "call_function" and v.target == aten.add.Tensor and not v.kwargs
            and len(v.args) == 2 and _const(1.0)(v.args[1], lookup, env)):
        return False
    w = v.args[0].args[0] if _to_fp32(v.args[0], lookup, env) else v.args[0]
    return _vector(w, lookup) is not None


def _norm_input_dtype(lookup, env) -> torch.dtype | None:
    """The dtype of the norm's input (before its cast to fp32) in the captured program, or None."""
    x = getattr(lookup, "captured", lambda node: None)(env["h"].args[0])
    return x.dtype if isinstance(x, torch.Tensor) else None


def _like_input(v, lookup, env) -> bool:
    """`y.type_as(v)` returns the norm input's dtype (what the fused norm returns), by the captured
    program's dtypes: v is the input, or its fp32 copy where the input is fp32. Unknown: no match."""
    like = getattr(lookup, "captured", lambda node: None)(v) if isinstance(v, fx.Node) else None
    return isinstance(like, torch.Tensor) and like.dtype == _norm_input_dtype(lookup, env)


def _input_dtype(v, lookup, env) -> bool:
    """`y.to(v)` casts back to the norm input's dtype (the captured one), which the fused norm returns."""
    return isinstance(v, torch.dtype) and v == _norm_input_dtype(lookup, env)


def _slice_start(v, lookup, env) -> bool:
    return v is None or v == 0


def _dim(d: int) -> Test:
    return lambda v, lookup, env: v == d


def _none(v, lookup, env) -> bool:
    return v is None


def _neg_inf(v, lookup, env) -> bool:
    return v == -math.inf


def _causal_buffer(v, lookup, env) -> bool:
    """A [1, 1, n, n] buffer, nonzero exactly on and below the diagonal (nanoGPT's `bias`), so
    `buf[:, :, :T, :T] == 0` is the causal mask of T queries and T keys."""
    if not (isinstance(v, fx.Node) and v.op == "get_attr"):
        return False
    t = lookup(v.target)
    if not isinstance(t, torch.Tensor) or t.is_meta or t.dim() != 4 or t.shape[:2] != (1, 1) or t.shape[2] != t.shape[3]:
        return False
    return torch.equal(t[0, 0] != 0, torch.ones(t.shape[2:], dtype=torch.bool, device=t.device).tril())


def _same_size(a: object, b: object) -> bool:
    """Two sizes known equal: equal ints, or symbolic sizes with the same expression."""
    if isinstance(a, torch.SymInt) and isinstance(b, torch.SymInt):
        return a.node.expr == b.node.expr
    return type(a) is int and type(b) is int and a == b


def _is_scores_length(v, lookup, env) -> bool:
    """The slice end T of the causal mask is both the query and the key length of the scores `s`
    (bound before it), by the captured program's shapes: then the sliced mask is exactly causal. A
    slice to any other length (a 1 x 1 mask would broadcast) or unknown shapes do not match."""
    captured = getattr(lookup, "captured", lambda node: None)
    scores = captured(env["s"]) if isinstance(env["s"], fx.Node) else None
    t = captured(v) if isinstance(v, fx.Node) else v
    return (isinstance(scores, torch.Tensor) and scores.dim() == 4
            and _same_size(scores.shape[-2], t) and _same_size(scores.shape[-1], t))


# ---- builders -----------------------------------------------------------------------------------------
# A builder gets `call` (passes/fuse.py's Inserter: `call(target, args, like=root)` inserts a node
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
    return call(fused.rotary.default, (env["x"], cos, sin, False, env["half"]))


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


_BIAS = V("b", _vector_param)
_LINEAR_BIAS = P((aten.linear.default,), (V("x"), V("w"), _BIAS), bind="lin")


def _gelu_tanh_written_out() -> P:
    """0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x ** 3))), as Hugging Face's gelu_new
    (GPT-2) traces: the tanh form of aten.gelu spelled in eight element-wise ops."""
    mul, add, x = (aten.mul.Tensor,), (aten.add.Tensor,), V("x")
    cubic = P(add, (x, P(mul, (P((aten.pow.Tensor_Scalar,), (x, V("three", _const(3.0)))),
                               V("c", _const(0.044715))))))
    inner = P((aten.tanh.default,), (P(mul, (cubic, V("k", _const(math.sqrt(2 / math.pi))))),))
    return P(mul, (P(mul, (x, V("half", _const(0.5)))), P(add, (inner, V("one", _const(1.0))))))


def _rms_norm_patterns() -> list[P]:
    """h * rsqrt(mean(h ** 2, -1, keepdim) + eps), h = x.to(float32), then scaled as Hugging Face's
    norms trace: LlamaRMSNorm's weight * normed.to(dtype) (dtype: the input's at capture, which must
    be the weight's), GemmaRMSNorm's (normed * (1 + weight.float())).type_as(x), and Olmo2's (and
    T5's) (weight * normed).to(x's dtype)."""
    h = V("h", _to_fp32)
    mean_sq = P((aten.mean.dim,), (P((aten.pow.Tensor_Scalar,), (h, V("two", _const(2.0)))), V("dims", _last_dim),
                                   V("keep", _true)))
    rstd = P((aten.rsqrt.default,), (P((aten.add.Tensor,), (mean_sq, V("eps", _number))),))
    normed = P((aten.mul.Tensor,), (h, rstd))
    llama = P((aten.mul.Tensor,), (V("w", _vector_param), P((aten.to.dtype,), (normed, V("dtype", _weight_dtype)))))
    gemma = P((aten.type_as.default,), (P((aten.mul.Tensor,), (normed, V("w", _one_plus_weight))),
                                        V("like", _like_input)))
    olmo2 = P((aten.to.dtype,), (P((aten.mul.Tensor,), (V("w", _vector_param), normed)), V("dtype", _input_dtype)))
    return [llama, gemma, olmo2]


def _rotary_written_out() -> P:
    """x * cos.unsqueeze(1) + cat([-x[..., h:], x[..., :h]], -1) * sin.unsqueeze(1), as Hugging
    Face's apply_rotary_pos_emb traces for q and for k ([b, heads, s, d]; slices on dim 3, which
    the op checks is the last). The tables come from a no-grad block: the fused op owes them none."""
    x, half, dim = V("x"), V("half", _int), V("dim", _dim_3)
    upper = P((aten.slice.Tensor,), (x, dim, half, V("end", _to_end)))
    lower = P((aten.slice.Tensor,), (x, dim, V("zero", _zero), half))
    rotated = P((aten.cat.default,), ([P((aten.neg.default,), (upper,)), lower], V("cat_dim", _dim_3)))
    return P((aten.add.Tensor,), (P((aten.mul.Tensor,), (x, V("cos", _heads_unsqueezed_table))),
                                  P((aten.mul.Tensor,), (rotated, V("sin", _heads_unsqueezed_table)))))


def _causal_softmax_patterns() -> list[P]:
    """softmax(scores [* scale | / d].masked_fill(buf[:, :, :T, :T] == 0, -inf), -1), as nanoGPT
    writes attention without SDPA: `buf` a causal [1, 1, n, n] buffer, T the scores' length."""
    s = V("s")
    scaled = [P((aten.mul.Tensor,), (s, V("scale", _number))), P((aten.div.Tensor,), (s, V("divisor", _number))), s]
    rows = P((aten.slice.Tensor,), (V("buf", _causal_buffer), V("d2", _dim(2)), V("start2", _slice_start),
                                    V("T", _is_scores_length)))
    mask = P((aten.eq.Scalar,), (P((aten.slice.Tensor,), (rows, V("d3", _dim(3)), V("start3", _slice_start), V("T"))),
                                 V("zero", _zero)))
    return [P((aten.softmax.int,), (P((aten.masked_fill.Scalar,), (x, mask, V("ninf", _neg_inf))),
                                    V("dim", _dim_3), V("dtype", _none, default=None)))
            for x in scaled]


def _no_draw_or_region(v, lookup, env) -> bool:
    """A dropout's p: 0 (no mask drawn), or any p where the dropout is a region's random-op module
    (the fused op then draws its mask from that region's generator)."""
    return v == 0 or (isinstance(v, (int, float)) and env["drop"].op == "call_module")


def _residual_patterns() -> list[P]:
    """res + [dropout]([view](y + b)), both operand orders, and res + linear(x, w, b). The view is
    the one a 2-D GEMM's output takes back to [b, s, h] (GPT-2's Conv1D); it must keep the last
    dim, the bias's. The dropout is one of p = 0, or a training dropout, which the rewrite made a
    module running it under its RNG region's generator: the fused op's mask is then its own hash
    of a seed drawn from that generator (the same distribution, not torch's mask)."""
    biased = [P((aten.add.Tensor,), (V("y"), _BIAS), bind="sum"), P((aten.add.Tensor,), (_BIAS, V("y")), bind="sum")]
    biased += [P((aten.view.default,), (b, V("shape", _keeps_bias_dim))) for b in biased]
    dropped = [P((aten.dropout.default,), (b, V("p", _no_draw_or_region), V("train", default=True)), bind="drop")
               for b in biased]
    inner = biased + dropped + [_LINEAR_BIAS]
    return [P((aten.add.Tensor,), (V("res"), i) if first else (i, V("res")))
            for i, first in itertools.product(inner, (True, False))]


RULES: list[tuple[str, P, Callable]] = [
    ("layer_norm", P((aten.layer_norm.default,),
                     (V("x"), V("shape", _last_dim_only), V("w", default=None), V("b", default=None),
                      V("eps", default=1e-5), V("cudnn_enable", default=True))), _layer_norm),
    ("bias_gelu", P((aten.gelu.default,), (_LINEAR_BIAS,), kwargs_ok=_gelu_ok), _bias_gelu),
    ("bias_gelu", P((aten.gelu.default,), (P((aten.add.Tensor,), (V("x"), _BIAS)),), kwargs_ok=_gelu_ok),
     _bias_gelu),
    *(("rms_norm", p, _rms_norm) for p in _rms_norm_patterns()),
    ("gelu_tanh", _gelu_tanh_written_out(), _gelu_tanh),
    ("rotary", _rotary_written_out(), _rotary),
    ("swiglu", P((aten.mul.Tensor,), (P((aten.silu.default,), (V("a"),)), V("u"))), _swiglu),
    ("swiglu", P((aten.mul.Tensor,), (V("u"), P((aten.silu.default,), (V("a"),)))), _swiglu),
    *(("bias_residual", p, _bias_residual) for p in _residual_patterns()),
    *(("causal_softmax", p, _causal_softmax) for p in _causal_softmax_patterns()),
]
