"""FP8: a rank graph's linears run in float8 (parallel/fp8_linear.py), but for those a table keeps
in bf16, each with its reason.

    table = fp8_table(captured_gm, param_of, shards, keep)     # weight -> None (FP8) or why bf16
    specs = rewrite_fp8_linears(rank_graph, table, recipe, param_of, split_dim, suffix, cp)

A linear is `aten.linear(x, w[, b])` with `w` a parameter (`param_of(get_attr target)` names it),
w [out, in]; or GPT-2's Conv1D, `aten.addmm(b, x, w)` (or `aten.mm(x, w)`, as tp's rewrite leaves
a row-parallel one whose bias it adds after g), w [in, out]; or `aten.matmul(x, w)`: `LINEAR_FORMS`
says where each form keeps its operands. A weight read through a transpose (Falcon's
`x @ self.weight.T`) has its output dim on the other side.
`KEEP_BF16`'s rows are tried in order; the first whose test holds keeps the linear in bf16 and
gives the reason `print(prog)` shows. `keep` names the weights the model's structure picks out
(autoshard/api.py reads them off the model): its output embedding (the LM head), its routers, and
its experts' stacked weights. An experts' grouped matmul (x [S, K] grouped by expert, w [E, K, N],
offsets: transformers' grouped_mm experts) on a weight in FP8 becomes a call of
parallel/fp8_experts.py's `fp8_grouped_mm`, each expert's matmul an FP8 linear of its own; experts
weights no grouped matmul reads are listed, kept in the model's dtype.
A linear in FP8 becomes the call of an Fp8Linear module, and its bias an add after it (in bf16,
as torchao adds it); a Conv1D's weight reaches it transposed, [out, in]. `split_dim(weight)`: the
dim tensor parallelism splits, else None; the linear is then column-parallel (its output features
split) or row-parallel (its input features; its amaxes are then taken over the group where they span
the split dim); at `cp` > 1 the amaxes over the tokens are taken over the context-parallel group.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.fx as fx

from autoshard.parallel.fp8_experts import GROUPED_MATMULS, fp8_grouped_mm
from autoshard.parallel.fp8_linear import Fp8LinearSpec

__all__ = ["KEEP_BF16", "LINEAR_FORMS", "Fp8Options", "fp8_table", "rewrite_fp8_linears"]


@dataclass(frozen=True)
class Fp8Options:
    """autoshard(precision="fp8")'s: the recipe, and the weights the model's structure keeps bf16
    (name -> "lm_head" or "router")."""
    recipe: str = "tensorwise"
    keep: dict[str, str] = field(default_factory=dict)

_aten = torch.ops.aten


@dataclass(frozen=True)
class LinearForm:
    """Where an op that is a linear layer keeps x, w and the bias, and which dim of w is its outputs'."""
    x: int
    w: int
    bias: int | None
    out_dim: int           # 0: w is [out, in] (nn.Linear); 1: w is [in, out] (Conv1D)


LINEAR_FORMS: dict[object, LinearForm] = {
    _aten.linear.default: LinearForm(x=0, w=1, bias=2, out_dim=0),      # nn.Linear, F.linear
    _aten.addmm.default: LinearForm(x=1, w=2, bias=0, out_dim=1),       # GPT-2's Conv1D: b + x @ w
    _aten.mm.default: LinearForm(x=0, w=1, bias=None, out_dim=1),       # a row-parallel Conv1D, its bias after g
    _aten.matmul.default: LinearForm(x=0, w=1, bias=None, out_dim=1),   # x @ w, x [..., in]
}
# a weight read through one of these is the transpose of the stored one (Falcon's x @ self.weight.T):
# its output dim is the other one
_TRANSPOSES = (_aten.t.default, _aten.numpy_T.default, _aten.transpose.int, _aten.permute.default)


# (reason, test(weight name, its [out, in] sizes whole and on each rank, keep)): the first that holds
# keeps the linear in bf16. An experts' weight's sizes are one expert's; [] where no grouped matmul
# reads it.
KEEP_BF16: list[tuple[str, Callable[[str, list[list[int]], dict[str, str]], bool]]] = [
    ("the LM head: its logits feed the loss, where FP8's error is the largest (Megatron and torchao keep it bf16)",
     lambda name, sizes, keep: keep.get(name) == "lm_head"),
    ("a router: it picks each token's experts, and an FP8 error could flip a choice",
     lambda name, sizes, keep: keep.get(name) == "router"),
    ("experts not run as a grouped matmul (transformers' grouped_mm experts): float8 is built for that form",
     lambda name, sizes, keep: keep.get(name) == "experts" and not sizes),
    ("experts split over tp ranks: their scales would need the tp group's max inside the experts call "
     "(not built)", lambda name, sizes, keep: keep.get(name) == "experts" and any(s != sizes[0] for s in sizes)),
    ("rows held by several tp ranks (kv heads fewer than tp): a rank's gradient for them is a partial "
     "sum until their sync, and FP8 would scale and round the partials, not the single-device sum",
     lambda name, sizes, keep: _held_twice(sizes)),
    ("its features are not multiples of 16 (torch._scaled_mm's rule), whole or on a tp shard",
     lambda name, sizes, keep: any(d % 16 for shape in sizes for d in shape)),
]


def _held_twice(sizes: list[list[int]]) -> bool:
    """Whether the tp shards (sizes[1:]) of a weight (sizes[0]) hold more rows of a split dim than it
    has: some are held by several ranks."""
    whole, shards = sizes[0], sizes[1:]
    return any(len(shards) > 1 and any(s[d] != whole[d] for s in shards) and sum(s[d] for s in shards) > whole[d]
               for d in range(len(whole)))


def _grouped_weight(n: fx.Node) -> fx.Node | None:
    """The get_attr a grouped matmul's w [E, K, N] reads, directly or as the transpose of a stored
    [E, N, K] (transformers' non-transposed experts)."""
    w = n.args[1] if len(n.args) > 1 else None
    if isinstance(w, fx.Node) and w.op == "call_function" and w.target is _aten.transpose.int \
            and sorted(d % 3 for d in w.args[1:]) == [1, 2]:
        w = w.args[0]
    return w if isinstance(w, fx.Node) and w.op == "get_attr" else None


def _grouped(graph: fx.Graph, param_of: Callable[[str], str | None]):
    """(node, weight name, get_attr) of each grouped matmul (x [S, K], w [E, K, N], offsets) on a
    parameter, without bias or output dtype."""
    for n in graph.nodes:
        if n.op != "call_function" or not isinstance(n.target, torch._ops.OpOverload) \
                or n.target.name().split(".")[0] not in GROUPED_MATMULS:
            continue
        w = _grouped_weight(n)
        extra = {k: v for k, v in n.kwargs.items() if k != "offs" and v is not None}
        if w is not None and param_of(w.target) is not None and not extra and len(n.args) <= 3:
            yield n, param_of(w.target), w


def _arg(n: fx.Node, i: int | None):
    return n.args[i] if i is not None and i < len(n.args) else None


def _stored(w: object) -> tuple[fx.Node | None, bool]:
    """The get_attr a linear's weight operand reads, and whether through a transpose of its two dims."""
    if isinstance(w, fx.Node) and w.op == "call_function" and w.target in _TRANSPOSES and len(w.users) == 1:
        dims = [d % 2 for d in (w.args[1] if w.target is _aten.permute.default else w.args[1:])]
        if w.target in (_aten.t.default, _aten.numpy_T.default) or dims in ([1, 0], [0, 1]):
            return (w.args[0] if isinstance(w.args[0], fx.Node) and w.args[0].op == "get_attr" else None), True
    return (w if isinstance(w, fx.Node) and w.op == "get_attr" else None), False


def _linears(graph: fx.Graph, param_of: Callable[[str], str | None]):
    """(node, weight name, form, the weight's get_attr, its output dim) of each linear on a 2-D
    parameter, read directly or through a transpose; the plain matmul forms only."""
    for n in graph.nodes:
        form = LINEAR_FORMS.get(n.target) if n.op == "call_function" else None
        if form is None or n.kwargs or (n.target is _aten.addmm.default and len(n.args) != 3):
            continue
        w, flipped = _stored(_arg(n, form.w))
        val = w.meta.get("val") if w is not None else None
        if w is not None and param_of(w.target) is not None and (val is None or val.dim() == 2):
            yield n, param_of(w.target), form, w, 1 - form.out_dim if flipped else form.out_dim


def fp8_table(captured: fx.GraphModule, param_of: Callable[[str], str | None],
              shards: Callable[[str, list[int]], list[list[int]]], keep: dict[str, str]) -> dict[str, str | None]:
    """Every linear's weight -> None where it runs in FP8, else the reason it stays bf16 (see the
    module doc), read off the captured graph; `shards(name, shape)`: its shape on each tp rank."""
    table: dict[str, str | None] = {}
    for n, name, form, w, _ in _linears(captured.graph, param_of):
        shape = list(captured.get_parameter(w.target).shape)
        sizes = [shape, *shards(name, shape)]
        table[name] = next((why for why, test in KEEP_BF16 if test(name, sizes, keep)), None)
    for n, name, w in _grouped(captured.graph, param_of):
        shape = list(captured.get_parameter(w.target).shape)
        sizes = [s[1:] for s in [shape, *shards(name, shape)]]          # one expert's, whole and on each rank
        table[name] = next((why for why, test in KEEP_BF16 if test(name, sizes, {**keep, name: "experts"})), None)
    for name, kind in keep.items():           # experts' weights no grouped matmul reads: listed with their reason
        if name not in table and kind == "experts":
            table[name] = next(why for why, test in KEEP_BF16 if test(name, [], keep))
    return table


def rewrite_fp8_linears(graph: fx.Graph, table: dict[str, str | None], recipe: str,
                        param_of: Callable[[str], str | None], split_dim: Callable[[str], int | None],
                        suffix: str = "", cp: int = 1) -> list[Fp8LinearSpec]:
    """Each linear the table runs in FP8 becomes an Fp8Linear module's call (+ its bias), in place;
    returns the modules' specs."""
    specs = []
    for n, name, form, w, out_dim in list(_linears(graph, param_of)):
        if table.get(name, "not in the table") is not None:
            continue
        dim = split_dim(name)
        role = None if dim is None else "column" if dim == out_dim else "row"
        spec = Fp8LinearSpec(f"fp8_{n.name}{suffix}", recipe, role, cp)
        x, operand, bias = _arg(n, form.x), _arg(n, form.w), _arg(n, form.bias)
        with graph.inserting_before(n):
            if out_dim == 1:
                w = graph.call_function(_aten.t.default, (w,))          # [in, out] -> [out, in]
            y = call = graph.call_module(spec.module, (x, w))
            if bias is not None:
                y = graph.call_function(_aten.add.Tensor, (call, bias))
        call.meta.update({k: v for k, v in n.meta.items() if k in ("captured", "val")})    # read as the linear
        n.replace_all_uses_with(y)
        graph.erase_node(n)
        if operand is not w and isinstance(operand, fx.Node) and not operand.users:
            graph.erase_node(operand)                                  # the transpose it read the weight through
        specs.append(spec)
    for n, name, _ in list(_grouped(graph, param_of)):
        if table.get(name, "not in the table") is None:
            offs = n.kwargs.get("offs", n.args[2] if len(n.args) > 2 else None)
            with graph.inserting_before(n):
                y = graph.call_function(fp8_grouped_mm, (n.args[0], n.args[1], offs, recipe))
            y.meta.update({k: v for k, v in n.meta.items() if k in ("captured", "val", "nn_module_stack")})
            n.replace_all_uses_with(y)
            graph.erase_node(n)
    return specs
