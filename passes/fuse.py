"""Fuse: swap subgraphs of a rank graph for the fused ops of autoshard.kernels (runs after rewrite).

The rewrites are data: `RULES` is a table of (name, pattern, build). A pattern is a tree of `P`
(a call_function node with one of some targets, its arguments matched in turn) and `V` (any value,
bound to a name, optionally tested); a name bound twice must bind the same node. A match's inner
nodes must have no other users (export's dtype assertions aside; they go with them); `build`
inserts the replacement before the matched root and returns it. Rows are tried in order at every
node.

    fused = fuse(graph, lookup)      # -> [(rule name, root node name)], graph rewritten in place

On CUDA the ops run the CuPy kernels, elsewhere their exact torch implementations, so a fused graph
computes what the unfused one does, in the same dtypes under autocast: the element-wise ops promote
like the adds they replace, a bias taken out of a linear is cast to the linear's output dtype, and
the norm runs in fp32 under CUDA autocast as layer_norm does. Two exceptions, both under CUDA
autocast only: the written-out tanh GeLU's `pow` runs in fp32 there, so the unfused activation
comes out fp32 where the fused one has the input's dtype (the same fp32 arithmetic, rounded once;
the GEMM that reads it casts to the low precision either way); and a written-out RMSNorm of a model
captured in bf16 casts back to bf16 where the fused norm, like layer_norm, returns fp32.

The ops broadcast like the torch code they replace (rank graphs carry no shapes to check), and
their CUDA kernels fall back to the torch implementation outside the plain case, so no pattern
needs shapes to be correct. Dropout with p > 0 is left alone: the fused kernel draws its mask from
its own counter-based hash, not from torch's generator, so it would change the masks.
"""
from __future__ import annotations

import itertools
import math
import operator
from dataclasses import dataclass
from typing import Callable

import torch
import torch.fx as fx

__all__ = ["P", "V", "RULES", "fuse"]

aten, fused = torch.ops.aten, torch.ops.autoshard


# a test on a bound value: (value, lookup of a get_attr target, the bindings made so far) -> ok
Test = Callable[[object, Callable[[str], object], dict], bool]


@dataclass(frozen=True)
class V:
    name: str
    test: Test | None = None
    default: object = ...                      # bound when the node has fewer arguments


@dataclass(frozen=True)
class P:
    targets: tuple
    args: tuple = ()
    bind: str | None = None
    kwargs_ok: Callable[[dict], bool] = lambda kw: not kw


# export's dtype assertions before a `.to`: not real users; they go with the node they check
_ASSERTS = (aten._assert_tensor_metadata.default,)
# bound values a fusion may leave without users, removed with it (pure casts)
_PURE = (aten.to.dtype,)


def _users(n: fx.Node) -> list[fx.Node]:
    return [u for u in n.users if u.target not in _ASSERTS]


def _match(pat: object, value: object, env: dict, inner: list[fx.Node], lookup, root: bool) -> bool:
    if isinstance(pat, V):
        if pat.name in env and env[pat.name] is not value:
            return False
        if pat.test is not None and not pat.test(value, lookup, env):
            return False
        env[pat.name] = value
        return True
    n = value
    if not (isinstance(n, fx.Node) and n.op == "call_function" and n.target in pat.targets
            and pat.kwargs_ok(dict(n.kwargs))):
        return False
    if not root:
        if len(_users(n)) != 1:
            return False
        inner.append(n)
    if pat.bind:
        env[pat.bind] = n
    for i, sub in enumerate(pat.args):
        if i < len(n.args):
            if not _match(sub, n.args[i], env, inner, lookup, False):
                return False
        elif isinstance(sub, V) and sub.default is not ...:
            env.setdefault(sub.name, sub.default)
        else:
            return False
    return True


# ---- tests on bound values -------------------------------------------------------------------------
def _vector_param(v, lookup, env) -> bool:
    """A 1-D parameter or buffer (a bias)."""
    if not (isinstance(v, fx.Node) and v.op == "get_attr"):
        return False
    t = lookup(v.target)
    return isinstance(t, torch.Tensor) and t.dim() == 1


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
    return isinstance(v, (list, tuple)) and v[-1] == lookup(env["b"].target).shape[0]


def _to_fp32(v, lookup, env) -> bool:
    """A node `x.to(torch.float32)` (nothing else in the call)."""
    return (isinstance(v, fx.Node) and v.op == "call_function" and v.target == aten.to.dtype and not v.kwargs
            and len(v.args) == 2 and v.args[1] == torch.float32)


def _weight_dtype(v, lookup, env) -> bool:
    """The dtype a written-out norm casts back to is its weight's, so weight * y.to(dtype) has the
    dtype the fused norm returns (the input's: export asserts it is the captured one)."""
    return isinstance(v, torch.dtype) and lookup(env["w"].target).dtype == v


# ---- builders -----------------------------------------------------------------------------------------
# A builder gets `call(target, args, like=root)`, which inserts a node carrying `like`'s meta (its
# module path places it in the right pipeline stage), the bound values and the matched root.
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


def _gelu_tanh(call: Call, env: dict, root: fx.Node) -> fx.Node:
    return call(fused.bias_gelu.default, (env["x"], None, "tanh"))


def _swiglu(call: Call, env: dict, root: fx.Node) -> fx.Node:
    return call(fused.swiglu.default, (env["a"], env["u"], None, None))


def _bias_residual(call: Call, env: dict, root: fx.Node) -> fx.Node:
    y, b = _take_bias_out(call, env) if "lin" in env else (env["y"], env["b"])
    if "shape" in env:                               # (y + b).view(shape) = y.view(shape) + b
        y = call(aten.view.default, (y, env["shape"]))
    return call(fused.bias_dropout_add.default, (y, b, env["res"], 0.0, 0))


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


def _rms_norm_written_out() -> P:
    """weight * (h * rsqrt(mean(h ** 2, -1, keepdim) + eps)).to(dtype), h = x.to(float32), as
    Hugging Face's LlamaRMSNorm traces (dtype: the input's at capture, which must be the weight's)."""
    h = V("h", _to_fp32)
    mean_sq = P((aten.mean.dim,), (P((aten.pow.Tensor_Scalar,), (h, V("two", _const(2.0)))), V("dims", _last_dim),
                                   V("keep", _true)))
    rstd = P((aten.rsqrt.default,), (P((aten.add.Tensor,), (mean_sq, V("eps", _number))),))
    normed = P((aten.mul.Tensor,), (h, rstd))
    return P((aten.mul.Tensor,), (V("w", _vector_param), P((aten.to.dtype,), (normed, V("dtype", _weight_dtype)))))


def _residual_patterns() -> list[P]:
    """res + [dropout(p=0)]([view](y + b)), both operand orders, and res + linear(x, w, b). The
    view is the one a 2-D GEMM's output takes back to [b, s, h] (GPT-2's Conv1D); it must keep the
    last dim, the bias's."""
    biased = [P((aten.add.Tensor,), (V("y"), _BIAS), bind="sum"), P((aten.add.Tensor,), (_BIAS, V("y")), bind="sum")]
    biased += [P((aten.view.default,), (b, V("shape", _keeps_bias_dim))) for b in biased]
    no_drop = biased + [P((aten.dropout.default,), (b, V("p", _zero))) for b in biased]
    inner = no_drop + [_LINEAR_BIAS]
    return [P((aten.add.Tensor,), (V("res"), i) if first else (i, V("res")))
            for i, first in itertools.product(inner, (True, False))]


RULES: list[tuple[str, P, Callable]] = [
    ("layer_norm", P((aten.layer_norm.default,),
                     (V("x"), V("shape", _last_dim_only), V("w", default=None), V("b", default=None),
                      V("eps", default=1e-5))), _layer_norm),
    ("bias_gelu", P((aten.gelu.default,), (_LINEAR_BIAS,), kwargs_ok=_gelu_ok), _bias_gelu),
    ("bias_gelu", P((aten.gelu.default,), (P((aten.add.Tensor,), (V("x"), _BIAS)),), kwargs_ok=_gelu_ok),
     _bias_gelu),
    ("rms_norm", _rms_norm_written_out(), _rms_norm),
    ("gelu_tanh", _gelu_tanh_written_out(), _gelu_tanh),
    ("swiglu", P((aten.mul.Tensor,), (P((aten.silu.default,), (V("a"),)), V("u"))), _swiglu),
    ("swiglu", P((aten.mul.Tensor,), (V("u"), P((aten.silu.default,), (V("a"),)))), _swiglu),
    *(("bias_residual", p, _bias_residual) for p in _residual_patterns()),
]


def fuse(graph: fx.Graph, lookup: Callable[[str], object],
         rules: list[tuple[str, P, Callable]] | None = None) -> list[tuple[str, str]]:
    """Apply `rules` (default RULES) to `graph` in place; `lookup(target)` gives a get_attr node's
    tensor. Returns (rule, root node) for each fusion made."""
    import autoshard.kernels  # noqa: F401  (registers torch.ops.autoshard.*; only when fusing)
    done = []
    for root in list(graph.nodes):
        if getattr(root, "_erased", False) or root.op != "call_function":
            continue                                  # erased by an earlier fusion, or not an op
        for name, pat, build in rules if rules is not None else RULES:
            env, inner = {}, []
            if not _match(pat, root, env, inner, lookup, True):
                continue
            def call(target, args, like=root):
                n = graph.call_function(target, args)
                n.meta = {k: v for k, v in like.meta.items() if like is not root or k != "val"}
                return n
            with graph.inserting_before(root):
                new = build(call, env, root)
            new.meta = {**root.meta, "fused": name, "replaces": root.name}
            root.replace_all_uses_with(new)
            graph.erase_node(root)
            for n in inner:                            # matched top-down: users before what they use
                for u in [u for u in n.users if u.target in _ASSERTS and not u.users]:
                    graph.erase_node(u)
                if not n.users:
                    graph.erase_node(n)
            for v in env.values():                     # a cast the match read, now read by nothing
                if isinstance(v, fx.Node) and v.op == "call_function" and v.target in _PURE and not v.users:
                    graph.erase_node(v)
            done.append((name, root.name))
            break
    graph.lint()
    return done
