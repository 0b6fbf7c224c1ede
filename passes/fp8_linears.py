"""FP8: a rank graph's linears run in float8 (parallel/fp8_linear.py), but for those a table keeps
in bf16, each with its reason.

    table = fp8_table(captured_gm, param_of, shards, keep)     # weight -> None (FP8) or why bf16
    specs = rewrite_fp8_linears(rank_graph, table, recipe, param_of, role_of, suffix)

A linear is `aten.linear(x, w[, b])` with `w` a parameter (`param_of(get_attr target)` names it).
`KEEP_BF16`'s rows are tried in order; the first whose test holds keeps the linear in bf16 and
gives the reason `print(prog)` shows. `keep` names the weights the model's structure picks out
(autoshard/api.py reads them off the model): its output embedding (the LM head) and its routers.
A linear in FP8 becomes the call of an Fp8Linear module, and its bias an add after it (in bf16,
as torchao adds it). `role_of(weight)`: "column" or "row" where tensor parallelism splits the
weight (its amaxes are then taken over the group where they span the split dim), else None; at
`cp` > 1 the amaxes over the tokens are taken over the context-parallel group.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.fx as fx

from autoshard.parallel.fp8_linear import Fp8LinearSpec

__all__ = ["KEEP_BF16", "Fp8Options", "fp8_table", "rewrite_fp8_linears"]


@dataclass(frozen=True)
class Fp8Options:
    """autoshard(precision="fp8")'s: the recipe, and the weights the model's structure keeps bf16
    (name -> "lm_head" or "router")."""
    recipe: str = "tensorwise"
    keep: dict[str, str] = field(default_factory=dict)

_LINEAR = torch.ops.aten.linear.default


# (reason, test(weight name, its [out, in] sizes whole and on each rank, keep)): the first that holds
# keeps the linear in bf16
KEEP_BF16: list[tuple[str, Callable[[str, list[list[int]], dict[str, str]], bool]]] = [
    ("the LM head: its logits feed the loss, where FP8's error is the largest (Megatron and torchao keep it bf16)",
     lambda name, sizes, keep: keep.get(name) == "lm_head"),
    ("a router: it picks each token's experts, and an FP8 error could flip a choice",
     lambda name, sizes, keep: keep.get(name) == "router"),
    ("its features are not multiples of 16 (torch._scaled_mm's rule), whole or on a tp shard",
     lambda name, sizes, keep: any(d % 16 for shape in sizes for d in shape)),
]


def _linears(graph: fx.Graph, param_of: Callable[[str], str | None]):
    for n in graph.nodes:
        if n.op == "call_function" and n.target is _LINEAR and isinstance(n.args[1], fx.Node) \
                and n.args[1].op == "get_attr" and param_of(n.args[1].target) is not None:
            yield n, param_of(n.args[1].target)


def fp8_table(captured: fx.GraphModule, param_of: Callable[[str], str | None],
              shards: Callable[[str, list[int]], list[list[int]]], keep: dict[str, str]) -> dict[str, str | None]:
    """Every linear's weight -> None where it runs in FP8, else the reason it stays bf16 (see the
    module doc), read off the captured graph; `shards(name, shape)`: its shape on each tp rank."""
    table: dict[str, str | None] = {}
    for n, name in _linears(captured.graph, param_of):
        shape = list(captured.get_parameter(n.args[1].target).shape)
        sizes = [shape, *shards(name, shape)]
        table[name] = next((why for why, test in KEEP_BF16 if test(name, sizes, keep)), None)
    return table


def rewrite_fp8_linears(graph: fx.Graph, table: dict[str, str | None], recipe: str,
                        param_of: Callable[[str], str | None], role_of: Callable[[str], str | None],
                        suffix: str = "", cp: int = 1) -> list[Fp8LinearSpec]:
    """Each linear the table runs in FP8 becomes an Fp8Linear module's call (+ its bias), in place;
    returns the modules' specs."""
    specs = []
    for n, name in list(_linears(graph, param_of)):
        if table.get(name, "not in the table") is not None:
            continue
        spec = Fp8LinearSpec(f"fp8_{n.name}{suffix}", recipe, role_of(name), cp)
        x, w, *rest = n.args
        with graph.inserting_before(n):
            y = call = graph.call_module(spec.module, (x, w))
            if rest and rest[0] is not None:
                y = graph.call_function(torch.ops.aten.add.Tensor, (call, rest[0]))
        call.meta.update({k: v for k, v in n.meta.items() if k in ("captured", "val")})    # read as the linear
        n.replace_all_uses_with(y)
        graph.erase_node(n)
        specs.append(spec)
    return specs
