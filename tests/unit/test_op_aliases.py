"""passes/op_aliases.py's table: every alias names ATen ops that exist, maps at least one overload to
the canonical op's overload of the same arguments, and a graph's alias calls are rewritten."""
import torch
import torch.fx as fx

from autoshard.passes.op_aliases import ALIASES, _canonical, rewrite_op_aliases

aten = torch.ops.aten


def test_every_alias_maps_an_overload_of_the_same_arguments():
    for alias, target in ALIASES.items():
        overloads = getattr(aten, alias).overloads()
        mapped = [o for o in overloads if _canonical(alias, o) is not None]
        assert mapped, (alias, target, overloads)
        for o in mapped:
            assert _canonical(alias, o)._schema.name == f"aten::{target}"


def test_a_graph_of_aliases_becomes_the_canonical_ops():
    g = fx.Graph()
    a, b = g.placeholder("a"), g.placeholder("b")
    m = g.call_function(aten.multiply.Tensor, (a, b))
    c = g.call_function(aten.concatenate.default, ([m, a], -1))
    g.output(g.call_function(aten.subtract.Tensor, (c, c)))
    gm = fx.GraphModule(torch.nn.Module(), g)
    assert rewrite_op_aliases(gm) == 3
    assert [n.target for n in gm.graph.nodes if n.op == "call_function"] == \
        [aten.mul.Tensor, aten.cat.default, aten.sub.Tensor]
    x = torch.randn(2, 3)
    assert torch.equal(gm(x, x), torch.zeros(2, 6))
