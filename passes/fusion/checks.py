"""Checks on the values a fusion pattern binds (passes/fusion/pattern.py's `V(name, test)`): each takes the
bound value, the lookup (passes/fusion/pattern.py's Facts: get_attr tensors, captured shapes and dtypes,
random-op modules) and the bindings made so far, and says whether the rule may fire. Used by the
rules table, passes/fusion/rules.py."""
from __future__ import annotations

import math
import operator

import torch
import torch.fx as fx

from autoshard.passes.fusion.pattern import Test

__all__ = [
    "captured_value", "equals", "is_bias_of", "is_shaped_like",
    "is_constant_table", "is_causal_buffer", "is_dim", "is_dim_3", "is_heads_unsqueezed_table",
    "is_input_dtype", "is_int", "is_last_dim", "is_last_dim_only", "is_like_input", "is_neg_inf",
    "is_no_draw_or_region", "is_no_grad_table", "is_none", "is_number", "is_one_plus_weight",
    "is_scores_length", "is_slice_start", "is_to_end", "is_to_fp32", "is_true", "is_vector_param",
    "is_weight_dtype", "is_zero", "keeps_bias_dim", "norm_input_dtype", "same_size", "vector_of",
]

aten = torch.ops.aten


def captured_value(v, lookup) -> object:
    """Node `v`'s value in the captured single-device program (Facts.captured), or None: not a node,
    or a plain lookup without captured values."""
    return getattr(lookup, "captured", lambda node: None)(v) if isinstance(v, fx.Node) else None


def vector_of(v, lookup) -> torch.Tensor | None:
    """The 1-D parameter or buffer (a bias) node `v` reads, directly or through f (identity
    forward, as sequence parallelism reads a bias: its gradient is summed over the sequence
    shards); else None."""
    if isinstance(v, fx.Node) and v.op == "call_module" and v.target == "f" and len(v.args) == 1:
        v = v.args[0]
    if not (isinstance(v, fx.Node) and v.op == "get_attr"):
        return None
    t = lookup(v.target)
    return t if isinstance(t, torch.Tensor) and t.dim() == 1 else None


def is_vector_param(v, lookup, env) -> bool:
    return vector_of(v, lookup) is not None


def is_last_dim_only(v, lookup, env) -> bool:
    return isinstance(v, (list, tuple)) and len(v) == 1


def is_zero(v, lookup, env) -> bool:
    return v == 0


def equals(c: float) -> Test:
    """A Python number equal to `c` to fp32 precision (traced constants such as sqrt(2 / pi))."""
    return lambda v, lookup, env: isinstance(v, (int, float)) and abs(v - c) <= 1e-6 * abs(c)


def is_number(v, lookup, env) -> bool:
    return isinstance(v, (int, float))


def is_last_dim(v, lookup, env) -> bool:
    return isinstance(v, (list, tuple)) and list(v) == [-1]


def is_true(v, lookup, env) -> bool:
    return v is True


def keeps_bias_dim(v, lookup, env) -> bool:
    """A view's shape whose last dim is the bias's length (so the bias can be added after it)."""
    return isinstance(v, (list, tuple)) and v[-1] == vector_of(env["b"], lookup).shape[0]


def is_no_grad_table(v: object) -> bool:
    """An output of a block traced under torch.no_grad (how Hugging Face builds its rotary cos and
    sin tables), so no gradient is owed to it."""
    if not (isinstance(v, fx.Node) and v.op == "call_function" and v.target is operator.getitem):
        return False
    block = v.args[0]
    return (isinstance(block, fx.Node) and getattr(block.target, "__name__", "") == "wrap_with_set_grad_enabled"
            and block.args[0] is False)


def is_constant_table(v: object, lookup) -> bool:
    """A node computed from buffers, integer inputs and constants alone (no trainable parameter,
    no floating-point input upstream), so no gradient is owed to it: how Hugging Face builds its
    rotary cos and sin tables since it stopped wrapping them in torch.no_grad (transformers 5.24)."""
    if not isinstance(v, fx.Node):
        return False
    seen, todo = set(), [v]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "get_attr":
            t = lookup(n.target)
            if isinstance(t, torch.nn.Parameter) and t.requires_grad:
                return False
        elif n.op == "placeholder":
            val = n.meta.get("val", captured_value(n, lookup))
            if not isinstance(val, torch.Tensor) or val.is_floating_point():
                return False                   # a floating input, or one whose value is unknown here
        elif n.op != "call_function":
            return False                       # a module (a collective, a random op) or an output
        elif n.target != aten.sym_size.int:    # a size carries no gradient: its tensor is not read
            todo.extend(n.all_input_nodes)
    return True


def is_heads_unsqueezed_table(v, lookup, env) -> bool:
    """table.unsqueeze(1), [b, s, d] -> [b, 1, s, d], of a rotary table no gradient is owed to."""
    return (isinstance(v, fx.Node) and v.op == "call_function" and v.target == aten.unsqueeze.default
            and v.args[1] == 1 and (is_no_grad_table(v.args[0]) or is_constant_table(v.args[0], lookup)))


def is_dim_3(v, lookup, env) -> bool:
    """The last dim of a [b, heads, s, d] tensor (the fused op refuses any other rank)."""
    return v in (3, -1)


def is_int(v, lookup, env) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_to_end(v, lookup, env) -> bool:
    return isinstance(v, int) and v >= 2**62             # slice to the end, as export writes x[..., h:]


def is_to_fp32(v, lookup, env) -> bool:
    """A node `x.to(torch.float32)` (nothing else in the call)."""
    return (isinstance(v, fx.Node) and v.op == "call_function" and v.target == aten.to.dtype and not v.kwargs
            and len(v.args) == 2 and v.args[1] == torch.float32)


def is_weight_dtype(v, lookup, env) -> bool:
    """The dtype a written-out norm casts back to is its weight's, so weight * y.to(dtype) has the
    dtype the fused norm returns (the input's: export asserts it is the captured one)."""
    return isinstance(v, torch.dtype) and vector_of(env["w"], lookup).dtype == v


def is_one_plus_weight(v, lookup, env) -> bool:
    """1 + w[.float()], w a 1-D parameter (Gemma's RMSNorm scales by one plus its weight): a node the
    fusion keeps as the fused norm's weight, so the weight's gradient still flows through it."""
    if not (isinstance(v, fx.Node) and v.op == "call_function" and v.target == aten.add.Tensor and not v.kwargs
            and len(v.args) == 2 and equals(1.0)(v.args[1], lookup, env)):
        return False
    w = v.args[0].args[0] if is_to_fp32(v.args[0], lookup, env) else v.args[0]
    return vector_of(w, lookup) is not None


def norm_input_dtype(lookup, env) -> torch.dtype | None:
    """The dtype of the norm's input (before its cast to fp32) in the captured program, or None."""
    x = captured_value(env["h"].args[0], lookup)
    return x.dtype if isinstance(x, torch.Tensor) else None


def is_like_input(v, lookup, env) -> bool:
    """`y.type_as(v)` returns the norm input's dtype (what the fused norm returns), by the captured
    program's dtypes: v is the input, or its fp32 copy where the input is fp32. Unknown: no match."""
    like = captured_value(v, lookup)
    return isinstance(like, torch.Tensor) and like.dtype == norm_input_dtype(lookup, env)


def is_input_dtype(v, lookup, env) -> bool:
    """`y.to(v)` casts back to the norm input's dtype (the captured one), which the fused norm returns."""
    return isinstance(v, torch.dtype) and v == norm_input_dtype(lookup, env)


def is_slice_start(v, lookup, env) -> bool:
    return v is None or v == 0


def is_dim(d: int) -> Test:
    return lambda v, lookup, env: v == d


def is_none(v, lookup, env) -> bool:
    return v is None


def is_neg_inf(v, lookup, env) -> bool:
    return v == -math.inf


def is_causal_buffer(v, lookup, env) -> bool:
    """A [1, 1, n, n] buffer, nonzero exactly on and below the diagonal (nanoGPT's `bias`), so
    `buf[:, :, :T, :T] == 0` is the causal mask of T queries and T keys."""
    if not (isinstance(v, fx.Node) and v.op == "get_attr"):
        return False
    t = lookup(v.target)
    if not isinstance(t, torch.Tensor) or t.is_meta or t.dim() != 4 or t.shape[:2] != (1, 1) or t.shape[2] != t.shape[3]:
        return False
    return torch.equal(t[0, 0] != 0, torch.ones(t.shape[2:], dtype=torch.bool, device=t.device).tril())


def same_size(a: object, b: object) -> bool:
    """Two sizes known equal: equal ints, or symbolic sizes with the same expression."""
    if isinstance(a, torch.SymInt) and isinstance(b, torch.SymInt):
        return a.node.expr == b.node.expr
    return type(a) is int and type(b) is int and a == b


def is_scores_length(v, lookup, env) -> bool:
    """The slice end T of the causal mask is both the query and the key length of the scores `s`
    (bound before it), by the captured program's shapes: then the sliced mask is exactly causal. A
    slice to any other length (a 1 x 1 mask would broadcast) or unknown shapes do not match."""
    scores = captured_value(env["s"], lookup)
    t = captured_value(v, lookup) if isinstance(v, fx.Node) else v
    return (isinstance(scores, torch.Tensor) and scores.dim() == 4
            and same_size(scores.shape[-2], t) and same_size(scores.shape[-1], t))


def is_no_draw_or_region(v, lookup, env) -> bool:
    """A dropout's p: 0 (no mask drawn), or any p where the dropout is a region's random-op module
    (the fused op then draws its mask from that region's generator)."""
    return v == 0 or (isinstance(v, (int, float)) and env["drop"].op == "call_module")


def _captured_shape(v, lookup) -> tuple | None:
    t = captured_value(v, lookup)
    return tuple(t.shape) if isinstance(t, torch.Tensor) else None


def is_shaped_like(name: str) -> Test:
    """The value's captured shape is that of the node bound as `name` (the result the fused op
    writes): the kernels read a full tensor in this slot, so an operand that broadcasts up to the
    result (a [cols] parameter multiplied in, a [rows, 1] column) must not match. Unknown shapes do
    not match either."""
    def test(v, lookup, env) -> bool:
        a, b = _captured_shape(v, lookup), _captured_shape(env.get(name), lookup)
        return a is not None and b is not None and len(a) == len(b) and all(map(same_size, a, b))
    return test


def is_bias_of(name: str) -> Test:
    """A 1-D parameter added along the last dim of the node bound as `name`: a bias the kernels
    read as [cols]. A one-element vector (which broadcasts over every column) matches only where
    the captured last dim is 1."""
    def test(v, lookup, env) -> bool:
        b = vector_of(v, lookup)
        if b is None:
            return False
        out = _captured_shape(env.get(name), lookup)
        return b.shape[0] > 1 or (out is not None and len(out) > 0 and same_size(out[-1], 1))
    return test
