"""Before the sharding analysis: leading dims merged into one for ops that treat each index of it
alone, kept as the dims they were.

    keep_merged_dims(gm)            # the captured graph, edited in place; returns how many regions

Two spellings merge the heads into a dim the table cannot cut:

    rows = x.reshape(-1, D)                        # rows for a row-wise op (Qwen3-Next's gated norm):
    y = norm(rows) * weight * silu(gate)           #   x [B, T, heads, D] -> [B*T*heads, D]
    out = y.reshape(B, T, heads, D)

    q = q.reshape(B * heads, T, hd)                # batch and heads for a batched matmul (Bloom,
    s = torch.baddbmm(alibi, q, k.transpose(1, 2)) #   DeBERTa-v2): [B, heads, T, hd] -> [B*heads, T, hd]
    s = s.view(B, heads, T, T)

With the heads split over the ranks, the merged dim holds each token's (or sample's) heads of this
rank only, a layout no even cut of B*T*heads describes (and B is symbolic). An op that treats each
index of dim 0 alone (elementwise, a reduction or softmax over another dim, a batched matmul, a
gather along another dim) gives the same values on the unmerged shape, so the region runs there:
its merging reshapes go (or reshape to the unmerged dims), dims named by number move right, bmm
and baddbmm become matmul (which takes any number of batch dims), and the heads stay a dim of their
own, which the table splits. Tensors the region reads from outside are merges of the same leading
dims, a tiling of the later ones over the first (DeBERTa's relative-position keys, repeated per
sample), an expand of a broadcast one to the merged size, or tensors that broadcast as they are; a
region ends at reshapes back to the leading dims. Anything else is left as written, as is a region
whose ops will not run on the unmerged shapes.
"""
from __future__ import annotations

import operator

import sympy
import torch
import torch.fx as fx

from autoshard.passes.graph_reading import op_name

__all__ = ["keep_merged_dims"]

aten = torch.ops.aten
_RESHAPES = {"reshape", "view", "_unsafe_view"}
# not tagged pointwise, but each output element reads the same element of its input
_SAME_ELEMENT = {"to", "_to_copy", "clone", "contiguous", "alias", "detach", "dropout", "type_as"}
_REDUCTIONS = {"mean", "sum", "amax", "amin"}
_BATCHED = {"bmm", "baddbmm", "matmul"}
# where each op names a dim (none of them may be dim 0, the merged one)
_DIM_ARGS = {"transpose": (1, 2), "softmax": (1,), "_softmax": (1,), "log_softmax": (1,), "_log_softmax": (1,),
             "gather": (1,), **{name: (1,) for name in _REDUCTIONS}}


def _dims(node: object) -> tuple[sympy.Expr, ...] | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    if not isinstance(val, torch.Tensor):
        return None
    return tuple(sympy.sympify(d.node.expr if isinstance(d, torch.SymInt) else d) for d in val.shape)


def _product(dims) -> sympy.Expr:
    out = sympy.Integer(1)
    for d in dims:
        out *= d
    return out


def _is_reshape(node: fx.Node) -> bool:
    return node.op == "call_function" and op_name(node.target) in _RESHAPES


def _merge(node: fx.Node) -> tuple[sympy.Expr, ...] | None:
    """The leading dims a reshape merges into its dim 0 (at least two, the rest of its source kept
    after them or reshaped), else None."""
    if not _is_reshape(node):
        return None
    src, out = _dims(node.args[0]), _dims(node)
    if src is None or out is None or len(out) < 2:
        return None
    for k in range(2, len(src)):
        if sympy.expand(_product(src[:k]) - out[0]) == 0 and sympy.expand(_product(src[k:]) - _product(out[1:])) == 0:
            return src[:k]
    return None


def _dims_ok(node: fx.Node) -> bool:
    """Whether every dim this op names is a positional int other than 0 (the merged dim): only those
    are moved right, so a dim passed by keyword leaves the region as written."""
    name = op_name(node.target)
    for i in _DIM_ARGS.get(name, ()):
        if len(node.args) <= i:
            return False
        d = node.args[i]
        ds = d if isinstance(d, (list, tuple)) else [d]
        if not ds or any(not isinstance(x, int) or x == 0 for x in ds):
            return False
    return True


def _treats_rows_alone(node: fx.Node) -> bool:
    if node.op != "call_function" or isinstance(node.target, type(operator.add)):
        return False
    name = op_name(node.target)
    if name in _BATCHED:
        return len(_dims(node) or ()) == 3 or name == "matmul"
    pointwise = torch.Tag.pointwise in getattr(node.target, "tags", ())
    return (pointwise or name in _SAME_ELEMENT or name in _DIM_ARGS) and _dims_ok(node)


def _broadcasts(arg: fx.Node, merged_rank: int) -> bool:
    """A tensor from outside the region that broadcasts against it unchanged: fewer dims than the
    region's merged values, or a leading 1."""
    dims = _dims(arg)
    return dims is None or len(dims) < merged_rank or (len(dims) == merged_rank and dims[0] == 1)


def _producer(arg: fx.Node, lead: tuple[sympy.Expr, ...]) -> str | None:
    """How `arg` (dim 0 the merged size) can be made unmerged: "merge", "tile" (repeat of a tensor
    whose dim 0 is the later leading dims, by the first), "expand" (of a broadcast tensor; the later
    leading dims literals)."""
    if _merge(arg) == lead:
        return "merge"
    dims = _dims(arg)
    if arg.op != "call_function" or not dims or sympy.expand(dims[0] - _product(lead)) != 0:
        return None
    name, src = op_name(arg.target), _dims(arg.args[0])
    if name == "repeat" and src and len(lead) == 2 and src[0] == lead[1] \
            and list(arg.args[1][1:]) == [1] * (len(src) - 1):
        return "tile"
    if name == "expand" and src and len(src) == len(dims) and src[0] == 1 and all(d.is_Integer for d in lead[1:]):
        return "expand"
    return None


def _region(seeds: list[fx.Node], lead: tuple[sympy.Expr, ...]):
    """(ops fed by `seeds`, the reshapes back to `lead` that end them, tensors from outside that must
    be unmerged too), or None where some op or read is not the pattern."""
    k = len(lead)
    region, exits, todo = set(seeds), [], list(seeds)
    while todo:
        for user in todo.pop().users:
            if user in region or user in exits:
                continue
            out = _dims(user)
            if _is_reshape(user) and out is not None and out[:k] == lead:
                exits.append(user)
                continue
            if not _treats_rows_alone(user):
                return None
            region.add(user)
            todo.append(user)
    ops = [n for n in seeds[0].graph.nodes if n in region and n not in seeds]
    rank = len(_dims(seeds[0]))
    joining: list[fx.Node] = []
    for n in ops:
        for arg in n.all_input_nodes:
            if arg not in region and not _broadcasts(arg, rank):
                above = _producers_above(arg, lead, rank)
                if above is None:
                    return None
                joining += above
    return (ops, exits, joining) if exits else None


def _producers_above(node: fx.Node, lead: tuple[sympy.Expr, ...], rank: int) -> list[fx.Node] | None:
    """The merges (or tilings, expands) of `lead` that `node` is computed from through ops that treat
    each row alone (a key transposed for the matmul: k.reshape(B * H, T, hd).transpose(1, 2)), or
    None where something else feeds it."""
    found, todo, seen = [], [node], set()
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if _producer(n, lead) is not None:
            found.append(n)
        elif _treats_rows_alone(n):
            todo += [a for a in n.all_input_nodes if not _broadcasts(a, rank)]
        else:
            return None
    return found


class _Builder:
    """Nodes inserted before a given node, each with its value computed as it is made, so that a
    region whose ops will not take the unmerged shapes is undone before anything else changes."""

    def __init__(self, graph: fx.Graph):
        self.graph, self.made = graph, []

    def call(self, before: fx.Node, target, *args) -> fx.Node:
        val = target(*fx.map_arg(args, lambda a: a.meta["val"]))
        with self.graph.inserting_before(before):
            node = self.graph.call_function(target, args)
        node.meta["val"] = val
        self.made.append(node)
        return node

    def sizes(self, before: fx.Node, src: fx.Node, dims: range) -> list:
        """src's sizes along `dims`: literals, or sym_size nodes for symbolic ones."""
        return [self.call(before, aten.sym_size.int, src, i) if isinstance(src.meta["val"].shape[i], torch.SymInt)
                else int(src.meta["val"].shape[i]) for i in dims]

    def undo(self) -> None:
        for node in reversed(self.made):
            self.graph.erase_node(node)


def _unmerged(b: _Builder, arg: fx.Node, how: str, lead: tuple[sympy.Expr, ...]) -> fx.Node:
    """The node that stands for `arg` with its dim 0 unmerged into len(lead) dims."""
    k, src = len(lead), arg.args[0]
    if how == "merge":
        if _dims(src)[k:] == _dims(arg)[1:]:
            return src
        return b.call(arg, aten.reshape.default, src, [*b.sizes(arg, src, range(k)), *list(arg.args[1])[1:]])
    if how == "tile":       # x [H, ..] repeated B times along dim 0: x[None] expanded over B
        first = b.call(arg, aten.unsqueeze.default, src, 0)
        return b.call(arg, aten.expand.default, first, [arg.args[1][0], *[-1] * len(_dims(src))])
    # expand of [1, ..] to [B*H, ..]: the expanded value viewed as [B, H, ..] (H a literal)
    nxt = arg.next
    rest = b.sizes(nxt, arg, range(1, len(_dims(arg))))
    return b.call(nxt, aten.reshape.default, arg, [-1, *[int(d) for d in lead[1:]], *rest])


def _rewrite(gm: fx.GraphModule, seed: fx.Node) -> list[fx.Node]:
    """Rewrite the region `seed` starts; the nodes erased (none when it is not the pattern)."""
    lead, seeds = _merge(seed), [seed]
    found = _region(seeds, lead)
    while found is not None and found[2]:          # the other tensors it reads join
        more = [f for f in dict.fromkeys(found[2]) if f not in seeds]
        if not more:                               # read past an exit: not the pattern
            return []
        seeds += more
        found = _region(seeds, lead)
    if found is None:
        return []
    ops, exits, _ = found
    graph, shift = gm.graph, len(lead) - 1
    b = _Builder(graph)
    # every value on the unmerged shapes first: the graph is edited only if all of them compute
    try:
        new = {s: _unmerged(b, s, _producer(s, lead), lead) for s in seeds}
        vals = {s: n.meta["val"] for s, n in new.items()}
        value = lambda a: vals.get(a, a.meta.get("val"))        # noqa: E731
        for n in ops:
            vals[n] = _call(n, shift, value)
        for e in exits:
            e.target(*fx.map_arg(e.args, value), **fx.map_arg(dict(e.kwargs), value))
    except Exception:       # noqa: BLE001 (an op that will not take the shapes: left as written)
        b.undo()
        return []
    for s, n in new.items():
        s.replace_all_uses_with(n, delete_user_cb=lambda u, n=n: u is not n and u not in b.made)
    for n in ops:
        _edit(b, n, shift, vals[n])
    erased = []
    for e in exits:
        if _dims(e) == _dims(e.args[0]):
            e.replace_all_uses_with(e.args[0])
            erased.append(e)
    for n in [*erased, *seeds]:
        if not n.users:
            graph.erase_node(n)
    return [*erased, *seeds]


def _moved(d, shift: int):
    if isinstance(d, (list, tuple)):
        return type(d)(_moved(x, shift) for x in d)
    return d + shift if d > 0 else d


def _moved_args(n: fx.Node, shift: int) -> list:
    args = list(n.args)
    for i in _DIM_ARGS.get(op_name(n.target), ()):
        if len(args) > i:
            args[i] = _moved(args[i], shift)
    return args


def _as_matmul(n: fx.Node, emit) -> tuple:
    """bmm / baddbmm (beta * input + alpha * b1 @ b2) as matmul, which takes any number of batch
    dims: (target, args) of the last step; the steps before it are made by `emit(target, *args)`
    (values when computing, nodes when editing)."""
    if op_name(n.target) == "bmm":
        return aten.matmul.default, tuple(n.args[:2])
    beta, alpha = n.kwargs.get("beta", 1), n.kwargs.get("alpha", 1)
    inp, b1, b2 = n.args[:3]
    prod = emit(aten.matmul.default, b1, b2)
    if alpha != 1:
        prod = emit(aten.mul.Tensor, prod, alpha)
    if beta != 1:
        inp = emit(aten.mul.Tensor, inp, beta)
    return aten.add.Tensor, (inp, prod)


def _call(n: fx.Node, shift: int, value) -> object:
    """The op's value on the unmerged shapes (`value` maps an argument node to its value)."""
    if op_name(n.target) in ("bmm", "baddbmm"):
        target, args = _as_matmul(n, lambda t, *a: t(*fx.map_arg(a, value)))
        return target(*fx.map_arg(args, value))
    return n.target(*fx.map_arg(_moved_args(n, shift), value), **fx.map_arg(dict(n.kwargs), value))


def _edit(b: _Builder, n: fx.Node, shift: int, val: object) -> None:
    if op_name(n.target) in ("bmm", "baddbmm"):
        n.target, n.args = _as_matmul(n, lambda t, *a: b.call(n, t, *a))
        n.kwargs = {}
    else:
        n.args = tuple(_moved_args(n, shift))
    n.meta["val"] = val


def keep_merged_dims(gm: fx.GraphModule) -> int:
    """Every region of the pattern rewritten; the number of regions."""
    done, erased = 0, set()
    for node in list(gm.graph.nodes):
        if node not in erased and _merge(node) is not None:
            gone = _rewrite(gm, node)
            erased.update(gone)
            done += bool(gone)
    if done:
        gm.graph.lint()
        gm.recompile()
    return done
