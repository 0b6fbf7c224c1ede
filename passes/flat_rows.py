"""Before the sharding analysis: rows flattened for a row-wise op, kept in their own shape.

    keep_rows_shaped(gm)            # the captured graph, edited in place; returns how many regions

The pattern (Qwen3-Next's gated norm over each head's output):

    rows = x.reshape(-1, D)                        # x: [B, T, heads, D] -> [B*T*heads, D]
    gate = z.reshape(-1, D)                        # z: the same leading dims
    y = norm(rows) * weight * silu(gate)           # row-wise: each row of D on its own
    out = y.reshape(B, T, heads, D)

With the heads split over the ranks, the flattened dim holds each token's heads of this rank only,
a layout no even cut of B*T*heads describes (and B*T is symbolic). Row-wise ops give the same rows
on either shape, so the region runs on [B, T, heads, D] and the two reshapes go: the heads stay a
dim of their own, which the table splits. A region is rewritten only when every op in it is in
ROW_WISE (a reduction only over the last dim, keeping it), every tensor it reads from outside is a
flatten of the same leading dims, a vector of the row's width or a scalar, and every value leaving
it is reshaped back to those leading dims; anything else is left as written.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from autoshard.passes.graph_reading import op_name

__all__ = ["ROW_WISE", "keep_rows_shaped"]

# ops that treat each row alone: elementwise ones, and reductions over the row (dim -1, keepdim)
ELEMENTWISE = {"to", "_to_copy", "clone", "pow", "rsqrt", "sqrt", "exp", "log", "neg", "abs", "silu", "sigmoid",
               "tanh", "relu", "gelu", "softplus", "add", "sub", "mul", "div", "where", "type_as"}
REDUCTIONS = {"mean", "sum", "amax", "amin"}
ROW_WISE = ELEMENTWISE | REDUCTIONS
_RESHAPES = {"reshape", "view", "_unsafe_view"}


def _shape(node: object) -> tuple[str, ...] | None:
    """A node's shape as text (symbolic sizes compared as written, without guarding on them)."""
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return tuple(str(d) for d in val.shape) if isinstance(val, torch.Tensor) else None


def _flattened(node: fx.Node) -> tuple[str, ...] | None:
    """The leading dims of x when `node` is x.reshape(-1, D) of an x of 3 dims or more, else None."""
    if node.op != "call_function" or op_name(node.target) not in _RESHAPES:
        return None
    src, out = _shape(node.args[0]), _shape(node)
    if src is None or out is None or len(src) < 3 or len(out) != 2 or out[1] != src[-1]:
        return None
    return src[:-1]


def _reduces_the_row(node: fx.Node) -> bool:
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    keep = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    return bool(keep) and isinstance(dims, (list, tuple)) and len(dims) == 1 and dims[0] in (1, -1)


def _broadcast_along_rows(arg: fx.Node) -> bool:
    """A tensor read from outside the region that broadcasts along its rows: a vector of the row's
    width, a [1, D] row, or a scalar."""
    shape = _shape(arg)
    return shape is None or len(shape) <= 1 or (len(shape) == 2 and shape[0] == "1")


def _region(seeds: list[fx.Node], lead: tuple[str, ...]):
    """(row-wise ops fed by `seeds`, the reshapes back to `lead` that end them, other flattens of
    `lead` they read), or None where some op or read is not the pattern."""
    region, exits, todo = set(seeds), [], list(seeds)
    while todo:
        for user in todo.pop().users:
            if user in region or user in exits:
                continue
            out = _shape(user)
            if user.op == "call_function" and op_name(user.target) in _RESHAPES and out is not None \
                    and out[:-1] == lead:
                exits.append(user)
                continue
            name = op_name(user.target) if user.op == "call_function" else None
            if name not in ROW_WISE or (name in REDUCTIONS and not _reduces_the_row(user)):
                return None
            region.add(user)
            todo.append(user)
    ops = [n for n in seeds[0].graph.nodes if n in region and n not in seeds]
    joining: list[fx.Node] = []
    for n in ops:
        for arg in n.all_input_nodes:
            if arg not in region and not _broadcast_along_rows(arg):
                above = _flattens_above(arg, lead)
                if above is None:
                    return None
                joining += above
    return (ops, exits, joining) if exits else None


def _flattens_above(node: fx.Node, lead: tuple[str, ...]) -> list[fx.Node] | None:
    """The flattens of `lead` that `node` is computed from through row-wise ops alone (a gated norm's
    gate: silu(z.reshape(-1, D))), or None where something else feeds it."""
    found, todo, seen = [], [node], set()
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if _flattened(n) == lead:
            found.append(n)
        elif n.op == "call_function" and op_name(n.target) in ELEMENTWISE:
            todo += [a for a in n.all_input_nodes if not _broadcast_along_rows(a)]
        else:
            return None
    return found


def _rewrite(gm: fx.GraphModule, seed: fx.Node) -> list[fx.Node]:
    """Rewrite the region `seed` starts; the nodes erased (none when it is not the pattern)."""
    lead, seeds = _flattened(seed), [seed]
    found = _region(seeds, lead)
    while found is not None and found[2]:          # the other flattens it reads (a gated norm's gate) join
        more = [f for f in dict.fromkeys(found[2]) if f not in seeds]
        if not more:                               # read past an exit: not the pattern
            return []
        seeds += more
        found = _region(seeds, lead)
    if found is None:
        return []
    ops, exits, _ = found
    # every op's value on the unflattened shapes first: the graph is edited only if all of them run
    vals = {f: f.args[0].meta["val"] for f in seeds}
    row = {n: [-1] for n in ops if op_name(n.target) in REDUCTIONS}
    try:
        for n in ops:
            args = list(fx.map_arg(n.args, lambda a: vals.get(a, a.meta.get("val"))))
            if n in row:
                args[1] = row[n]
            vals[n] = n.target(*args, **fx.map_arg(n.kwargs, lambda a: vals.get(a, a.meta.get("val"))))
    except Exception:       # noqa: BLE001 (an op that will not take the shapes: left as written)
        return []
    for f in seeds:
        f.replace_all_uses_with(f.args[0])
    for n in ops:
        if n in row:
            n.update_arg(1, row[n])
        n.meta["val"] = vals[n]
    for e in exits:
        e.replace_all_uses_with(e.args[0])
    for n in [*exits, *seeds]:
        gm.graph.erase_node(n)
    return [*exits, *seeds]


def keep_rows_shaped(gm: fx.GraphModule) -> int:
    """Every region of the pattern rewritten; the number of regions."""
    done, erased = 0, set()
    for node in list(gm.graph.nodes):
        if node not in erased and _flattened(node) is not None:
            gone = _rewrite(gm, node)
            erased.update(gone)
            done += bool(gone)
    if done:
        gm.graph.lint()
        gm.recompile()
    return done
