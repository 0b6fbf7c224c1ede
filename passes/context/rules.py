"""The context-parallel pass's rules, one function per row name of tokens.py's TOKEN_RULES (and
the kinds the pass finds itself: per element, a tuple's item, an experts module's inside, a module
call). Each takes the splitter (`sp`: passes/context/split.py's state: shapes, tags, what is
computed, how to cut a table) and the node, sets `sp.tags[node]`, and may cut the tables the node
reads to this rank's tokens. Attention and matmuls, where tokens meet tokens, are attention.py's.
"""
from __future__ import annotations

import sympy
import torch
import torch.fx as fx

from autoshard.passes.context.sizes import local_size, static_size
from autoshard.passes.context.tokens import LOCAL, mixed_dims

__all__ = ["token_wise", "other", "elementwise", "tag_at", "cut_tables", "ordered", "map_in_order",
           "map_in_order_one", "permute", "mixing", "item", "sized", "cat", "embedding", "linear", "loss",
           "gather_module", "refused_module"]

aten = torch.ops.aten
Tags = tuple  # per dim: LOCAL, GLOBAL or None (not a token dim)


def token_wise(sp, n: fx.Node) -> None:
    """Inside an experts module: this rank's tokens sorted, grouped and scattered back among themselves."""
    shape = sp.shape(n)
    if shape is None:
        sp.refuse(n, "its shape is unknown")
    one = lambda s: tuple(LOCAL if sp.is_token(e) else None for e in s)    # noqa: E731
    sp.tags[n] = [one(s) for s in shape] if shape and isinstance(shape[0], list) else one(shape)
    for a in n.all_input_nodes:
        if a in sp.computed or not sp.token_dims(_flat_shape(sp.shape(a))):
            continue
        if a.target != aten.arange.default or not isinstance(a.args[0], fx.Node):
            sp.refuse(n, f"a table ({a.name}) with the sequence's tokens meets this rank's tokens inside "
                           "an experts module")
        with sp.graph.inserting_before(n):      # an enumeration of this rank's (token, slot) pairs
            local = sp.graph.create_node("call_function", a.target, (local_size(sp, a.args[0]),
                                                                       *a.args[1:]), dict(a.kwargs))
        n.replace_input_with(a, local)


def other(sp, n: fx.Node) -> None:
    touched = [a for a in n.all_input_nodes if sp.token_dims(_flat_shape(sp.shape(a)))]
    if touched or sp.token_dims(_flat_shape(sp.shape(n))):
        sp.refuse(n, "no rule says how this op carries the sequence's tokens (passes/context/tokens.py's "
                       "TOKEN_RULES); context parallelism cannot split it")
    sp.tags[n] = _none_tags(sp.shape(n))


def convolution(sp, n: fx.Node) -> None:
    """A convolution over the sequence (Mamba's and the short convolutions' causal conv1d) reads,
    for each of this rank's tokens, the k - 1 before it, which the previous context-parallel rank
    holds for its first ones. Passing them is not built: refused, naming the layer (convolving a
    rank's slice as if it were the sequence would be wrong at its first k - 1 tokens, silently)."""
    x, w = n.args[0], n.args[1]
    if isinstance(x, fx.Node) and sp.token_dims(_flat_shape(sp.shape(x))):
        shape = sp.shape(w) if isinstance(w, fx.Node) else None
        k = shape[-1] if isinstance(shape, list) and shape else "k"
        sp.refuse(n, f"a convolution over the sequence (kernel {k}) reads the tokens before each of this "
                     f"rank's, which the previous context-parallel rank holds; passing them between ranks "
                     f"is not built, so cp cannot split this layer")
    other(sp, n)


def elementwise(sp, n: fx.Node) -> None:
    """Right-aligned broadcast: each output token dim takes the tag of the computed operands'
    aligned dims (LOCAL when only tables provide it); tables are cut where it is LOCAL."""
    out = sp.shape(n)
    if not isinstance(out, list) or (out and isinstance(out[0], list)):
        return other(sp, n)
    operands = [a for a in n.all_input_nodes if isinstance(sp.shape(a), list) and
                not (sp.shape(a) and isinstance(sp.shape(a)[0], list))]
    tags = [None] * len(out)
    for i in sp.token_dims(out):
        found = {tag_at(sp, a, i - len(out) + len(sp.shape(a))) for a in operands if a in sp.computed}
        found.discard(None)
        if len(found) > 1:
            sp.refuse(n, f"dim {i} meets this rank's tokens and every token (a shape the pass cannot split)")
        tags[i] = found.pop() if found else LOCAL
    sp.tags[n] = tuple(tags)
    cut_tables(sp, n, operands, tags)


def tag_at(sp, a: fx.Node, d: int) -> str | None:
    if d < 0:
        return None
    t = sp.tags.get(a)
    return t[d] if t is not None and d < len(t) else None


def cut_tables(sp, n: fx.Node, operands: list[fx.Node], tags: list) -> None:
    for a in operands:
        if a in sp.computed:
            continue
        shape = sp.shape(a)
        lead = len(tags) - len(shape)
        dims = [d for d in sp.token_dims(shape) if tags[d + lead] == LOCAL]
        if dims:
            n.replace_input_with(a, sp.cut_table(a, dims, before=n))


def ordered(sp, n: fx.Node) -> None:
    """A view keeping token dims in order: the k-th token dim of the output is the input's k-th."""
    src = n.args[0]
    if src not in sp.computed:
        return elementwise(sp, n)          # a table reshaped by computed sizes: treat as broadcast
    in_tags = [sp.tags[src][d] for d in sp.token_dims(sp.shape(src))]
    if n.target in (aten.slice.Tensor, aten.select.int, aten.narrow.default):
        dim = (n.args[1] if len(n.args) > 1 else 0) % len(sp.shape(src))
        if sp.tags[src][dim] == LOCAL and not _whole_slice(n):
            sp.refuse(n, f"it takes part of dim {dim}, which holds this rank's tokens only")
    sp.tags[n] = map_in_order(sp, n, in_tags)
    if n.target != aten.expand.default:
        _same_tokens(sp, n, src)


def rank_part(sp, n: fx.Node) -> None:
    """A tensor-parallel rank's part of a dim, the rewrite's slice (passes/rewrite/edits.py's
    Restrict). Of a dim holding this rank's tokens, in a static graph (sequence parallelism's chunk
    of the tokens, taken from a replicated value such as a position embedding): the same part of
    this rank's tokens, whose local order sequence parallelism's reduce-scatter chunks alike, so the
    bounds are divided by cp."""
    src = n.args[0]
    dim = n.args[1] % len(sp.shape(src))
    if src not in sp.computed or sp.tags[src][dim] != LOCAL:
        return ordered(sp, n)
    start, end = n.args[2], n.args[3]
    if sp.symbolic is None or start % sp.cp or end % sp.cp:
        sp.refuse(n, f"it takes a tensor-parallel rank's part [{start}:{end}] of dim {dim}, which holds this rank's "
                     f"tokens, and the pass cannot give the same part of them")
    shape = list(sp.shape(src))
    shape[dim] = shape[dim] * sympy.Rational(end - start, static_size(sp, shape[dim]))
    sp.shapes[n] = shape
    n.args = (src, n.args[1], start // sp.cp, end // sp.cp)
    sp.tags[n] = tuple(sp.tags[src])


def _same_tokens(sp, n: fx.Node, src: fx.Node) -> None:
    """A view may merge a token dim with others or split other dims off it ([B, S] -> [B * S], a
    token's top-k slots [B * S * k] -> [B * S, k]) but must keep the sequence whole: [B, S, H] ->
    [B, S / 2, 2H] pairs neighbouring tokens, which a rank's pieces do not keep together. So every
    LOCAL token dim of the output is the sequence length times a whole number of other things."""
    shape = sp.shape(n)
    outs = shape if shape and isinstance(shape[0], list) else [shape]
    in_tags = [sp.tags[src][d] for d in sp.token_dims(sp.shape(src))]
    for out in outs:
        for e, tag in zip([out[d] for d in sp.token_dims(out)], in_tags):
            seq = next(iter(sp.seqs & e.free_symbols), None)
            rest = sympy.simplify(e / seq) if seq is not None else None
            whole = rest is not None and not sp.is_token(rest) and sympy.fraction(rest)[1] == 1 and \
                rest.as_coeff_Mul()[0].is_integer
            if tag == LOCAL and not whole:
                sp.refuse(n, f"it reshapes a token dim into {e}: tokens would be grouped or split across a "
                             "rank's pieces")


def map_in_order(sp, n: fx.Node, in_tags: list) -> object:
    out = sp.shape(n)
    if out and isinstance(out[0], list):           # split / chunk / unbind: every piece alike
        return [map_in_order_one(sp, n, o, in_tags) for o in out]
    return map_in_order_one(sp, n, out, in_tags)


def map_in_order_one(sp, n: fx.Node, out: list, in_tags: list) -> Tags:
    dims = sp.token_dims(out)
    if n.target == aten.expand.default and len(dims) > len(in_tags):    # size-1 dims grown to S: local
        in_tags = [LOCAL] * (len(dims) - len(in_tags)) + list(in_tags)
    if len(dims) != len(in_tags):
        sp.refuse(n, f"its input has {len(in_tags)} token dims and its output {len(dims)}")
    tags = [None] * len(out)
    for d, t in zip(dims, in_tags):
        tags[d] = t
    return tuple(tags)


def permute(sp, n: fx.Node) -> None:
    src = n.args[0]
    t = list(sp.tags[src])
    nd = len(t)
    if n.target == aten.transpose.int:
        a, b = n.args[1] % nd, n.args[2] % nd
        t[a], t[b] = t[b], t[a]
    elif n.target == aten.t.default:
        t = t[::-1]
    else:
        t = [t[d % nd] for d in n.args[1]]
    sp.tags[n] = tuple(t)


def mixing(sp, n: fx.Node) -> None:
    src = n.args[0]
    shape = sp.shape(src)
    for d in mixed_dims(n.target, n.args, len(shape)):
        if sp.tags[src][d] == LOCAL:
            sp.refuse(n, f"it reads along dim {d}, which holds this rank's tokens only (a reduction or "
                           "scan over the sequence: the other ranks' tokens would be missing)")
    out = sp.shape(n)
    outs = out if out and isinstance(out[0], list) else [out]
    mapped = [tuple(sp.tags[src]) if len(o) == len(shape) else
              map_in_order_one(sp, n, o, [sp.tags[src][d] for d in sp.token_dims(shape)
                                            if d not in mixed_dims(n.target, n.args, len(shape))])
              for o in outs]
    sp.tags[n] = mapped if out and isinstance(out[0], list) else mapped[0]


def item(sp, n: fx.Node) -> None:
    tags = sp.tags[n.args[0]]
    sp.tags[n] = tags[n.args[1]] if isinstance(tags, list) else tags


def sized(sp, n: fx.Node) -> None:
    """new_zeros / new_ones / ... of a computed tensor: token dims of the size are LOCAL."""
    sp.tags[n] = tuple(LOCAL if sp.is_token(e) else None for e in sp.shape(n))


def cat(sp, n: fx.Node) -> None:
    dim = (n.args[1] if len(n.args) > 1 else 0) % len(sp.shape(n))
    if sp.is_token(sp.shape(n)[dim]):
        sp.refuse(n, f"it concatenates along dim {dim}, a token dim")
    sp.tags[n] = _parts_tokens(sp, n, "concatenates")


def _parts_tokens(sp, n: fx.Node, verb: str) -> tuple:
    """The token tags the computed parts of a cat or stack share (refused when they differ, or when a
    table with token dims joins them)."""
    for p in n.args[0]:
        if p not in sp.computed and sp.token_dims(sp.shape(p)):
            sp.refuse(n, f"it {verb} a table with this rank's tokens")
    tags = {sp.tags[p] for p in n.args[0] if p in sp.computed}
    if len(tags) != 1:
        sp.refuse(n, "its parts hold different tokens")
    return tags.pop()


def per_head_norm(sp, n: fx.Node) -> None:
    """kernels/norm_ops.py's per_head_layer_norm(x, w, b, dim, k, eps) (StableLM's q/k layernorm per
    head): each head of each token normalized over its last k dims alone, so x's token dims carry
    through, as long as none of them is normalized."""
    x, k = n.args[0], n.args[4]
    shape = sp.shape(x)
    for d in range(len(shape) - k, len(shape)):
        if sp.tags[x][d] == LOCAL:
            sp.refuse(n, f"it normalizes along dim {d}, which holds this rank's tokens only")
    if any(sp.token_dims(_flat_shape(sp.shape(a))) for a in n.all_input_nodes if a is not x):
        sp.refuse(n, "its weight or bias has a token dim")
    sp.tags[n] = tuple(sp.tags[x])


def stack(sp, n: fx.Node) -> None:
    """stack(parts, dim): parts holding the same tokens (interleaved rotary's [-x2, x1] pairs, Cohere
    and GPT-J), the new dim inserted at `dim` holds none."""
    dim = (n.args[1] if len(n.args) > 1 else 0) % len(sp.shape(n))
    tag = _parts_tokens(sp, n, "stacks")
    sp.tags[n] = (*tag[:dim], None, *tag[dim:])


def embedding(sp, n: fx.Node) -> None:
    weight, ids = n.args[:2]
    if weight in sp.computed and ids in sp.computed:
        sp.tags[n] = (*sp.tags[ids], None)
        return
    dims = sp.token_dims(sp.shape(ids))
    local = sp.cut_table(ids, dims, before=n) if dims else ids
    n.replace_input_with(ids, local)
    sp.tags[n] = (*(LOCAL if d in dims else None for d in range(len(sp.shape(ids)))), None)


def linear(sp, n: fx.Node) -> None:
    x, w = n.args[:2]
    if any(sp.token_dims(sp.shape(a)) for a in n.all_input_nodes if a is not x):
        sp.refuse(n, "its weight or bias has a token dim")
    if x not in sp.computed:
        dims = sp.token_dims(sp.shape(x))
        if dims:
            x_local = sp.cut_table(x, dims, before=n)
            n.replace_input_with(x, x_local)
            x = x_local
    sp.tags[n] = (*sp.tags[x][:-1], None)


def loss(sp, n: fx.Node) -> None:
    """A mean cross-entropy over this rank's tokens: its target (a table) is cut like the logits."""
    logits, target = n.args[:2]
    reduction = n.kwargs.get("reduction", n.args[3] if len(n.args) > 3 else 1)
    if reduction != 1:
        sp.refuse(n, f"a cross-entropy with reduction {reduction} (only the mean is weighted across ranks)")
    if target in sp.computed:
        sp.refuse(n, "its target is computed from parameters")
    lt = sp.tags[logits]
    tshape = sp.shape(target)
    dims = [d for d in sp.token_dims(tshape) if d < len(lt) and lt[d] == LOCAL]
    if dims:
        n.replace_input_with(target, sp.cut_table(target, dims, before=n))
    sp.tags[n] = ()


def gather_module(sp, n: fx.Node) -> None:
    src = n.args[0]
    sp.tags[n] = map_in_order(sp, n, [sp.tags[src][d] for d in sp.token_dims(sp.shape(src))])


def refused_module(sp, n: fx.Node) -> None:
    sp.refuse(n, f"module {n.target} is not built with context parallelism")


def _flat_shape(shape):
    if shape and isinstance(shape[0], list):
        return [e for s in shape for e in s]
    return shape


def _none_tags(shape):
    if shape is None:
        return None
    if shape and isinstance(shape[0], list):
        return [tuple(None for _ in s) for s in shape]
    return tuple(None for _ in shape)


def _whole_slice(n: fx.Node) -> bool:
    if n.target != aten.slice.Tensor:
        return False
    start = n.args[2] if len(n.args) > 2 else None
    end = n.args[3] if len(n.args) > 3 else None
    step = n.args[4] if len(n.args) > 4 else 1
    return start in (None, 0) and (end is None or (isinstance(end, int) and end >= 2 ** 62)) and step == 1
