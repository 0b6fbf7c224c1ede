"""Reading an exported graph: which parameter a node reads, and which module a node came from."""
from __future__ import annotations

import operator

import torch.fx as fx

__all__ = ["param_read", "module_path", "op_name", "weight_values"]


def op_name(target: object) -> str:
    """An op's short name: "view" for aten.view.default, "getitem" for operator.getitem; other Python
    operators keep their module ("operator.mul": size arithmetic on SymInts, not aten's mul)."""
    if target is operator.getitem:
        return "getitem"
    if getattr(target, "__module__", None) in ("operator", "_operator"):
        return f"operator.{target.__name__}"
    schema = getattr(target, "_schema", None)
    if schema is not None:
        return schema.name.split("::")[-1]
    return getattr(target, "__name__", str(target))


def param_read(arg: object, param_names: dict[str, str]) -> tuple[str, bool] | None:
    """(parameter name, transposed) when `arg` reads a parameter directly, through a transpose of
    its last two dims (2-D, or a stacked [experts, out, in] weight), or through a squeeze of a
    size-1 dim that an unsqueeze puts back (LFM2's `conv.weight.squeeze(1)` handed to a helper that
    unsqueezes it again: the same tensor, element for element)."""
    if not isinstance(arg, fx.Node):
        return None
    if arg.op == "get_attr" and arg.target in param_names:
        return param_names[arg.target], False
    name = getattr(arg.target, "__name__", "")
    if arg.op == "call_function" and name == "unsqueeze.default" and _undoes_a_squeeze(arg):
        inner = param_read(arg.args[0].args[0], param_names)
        return inner if inner and not inner[1] else None
    if arg.op == "call_function" and (name in ("t.default", "numpy_T.default") or
                                      (name == "transpose.int" and _swaps_last_two(arg))):
        inner = param_read(arg.args[0], param_names)
        return (inner[0], not inner[1]) if inner else None
    return None


def _undoes_a_squeeze(unsqueeze: fx.Node) -> bool:
    """unsqueeze(squeeze(x, d), d) with x's dim d of size 1: x itself."""
    inner = unsqueeze.args[0]
    if not (isinstance(inner, fx.Node) and inner.op == "call_function"
            and getattr(inner.target, "__name__", "") == "squeeze.dim" and isinstance(inner.args[0], fx.Node)):
        return False
    before, after = inner.args[0].meta.get("val"), unsqueeze.meta.get("val")
    nd = before.dim() if before is not None else 0
    return (before is not None and after is not None and tuple(before.shape) == tuple(after.shape)
            and inner.args[1] % max(nd, 1) == unsqueeze.args[1] % max(nd, 1))


def _swaps_last_two(node: fx.Node) -> bool:
    """transpose(x, a, b) exchanging x's last two dims (a 2-D transpose, or [experts, out, in] ->
    [experts, in, out] of a stacked expert weight)."""
    nd = len(node.meta["val"].shape)
    return nd >= 2 and sorted(d % nd for d in node.args[1:3]) == [nd - 2, nd - 1]


def module_path(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return "<top>"
    path, cls = list(stack.values())[-1]
    cls = cls if isinstance(cls, str) else getattr(cls, "__name__", str(cls))
    return f"{path or '<top>'} ({cls.rsplit('.', 1)[-1]})"


_OPS = ("call_function", "call_method", "call_module")


def weight_values(graph: fx.Graph) -> set[fx.Node]:
    """get_attr nodes and the nodes computed from them alone (a transpose, a cast, sp's f on a norm
    weight); a recomputed region's call is never one (its body runs activations)."""
    out: set[fx.Node] = set()
    for n in graph.nodes:
        if n.op == "get_attr" or (n.op in _OPS and not n.meta.get("recompute") and n.all_input_nodes
                                  and all(a in out for a in n.all_input_nodes)):
            out.add(n)
    return out
