"""The passes called on their own, without autoshard(): capture -> annotate -> rewrite -> stages."""
import pytest
import torch
import torch.fx as fx
from torch import nn

from autoshard.compile.capture import capture, normalize_inputs
from autoshard.errors import ShardingError
from autoshard.passes.rewrite.rank_rewrite import rewrite_rank
from autoshard.passes.sharding.annotate import annotate
from autoshard.passes.sharding.placement import ColumnInput, RowParallel, Shard
from autoshard.passes.stages import split_stages


class Block(nn.Module):
    def __init__(self, d: int = 8):
        super().__init__()
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class Stack(nn.Module):
    def __init__(self, n: int = 4, d: int = 8):
        super().__init__()
        self.layers = nn.ModuleList(Block(d) for _ in range(n))
        self.head = nn.Linear(d, 3)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _captured(model: nn.Module):
    x = torch.randn(2, 5, 8)
    return capture(model, normalize_inputs(model, (x,), {}))


def _node(gm, name):
    return next(n for n in gm.graph.nodes if n.name == name)


def test_annotate_marks_column_then_row_and_writes_only_meta():
    cap = _captured(Block())
    before = [(n.op, n.target) for n in cap.gm.graph.nodes]
    plan = annotate(cap.gm, 2, cap.param_names)
    assert [(n.op, n.target) for n in cap.gm.graph.nodes] == before       # analysis: no rewrite
    assert plan.params["up.weight"].dim == 0 and plan.params["up.weight"].layout == (((0, 16),), ((16, 32),))
    assert plan.params["up.bias"].dim == 0
    assert plan.params["down.weight"].dim == 1 and "down.bias" not in plan.params
    up, down = (n for n in cap.gm.graph.nodes if n.op == "call_function" and "linear" in str(n.target))
    assert isinstance(up.meta["sharding"].placement, Shard) and up.meta["sharding"].role == "column"
    assert any(isinstance(e, ColumnInput) for e in up.meta["sharding"].edits)
    assert any(isinstance(e, RowParallel) for e in down.meta["sharding"].edits)
    assert plan.fallbacks == [] and plan.skipped == []


def test_annotate_pads_features_tp_does_not_divide_with_zero_rows():
    cap = _captured(Block())
    plan = annotate(cap.gm, 3, cap.param_names)            # 32 hidden features over 3 ranks
    use = plan.params["up.weight"]
    assert use.padded == 33 and [sum(b - a for a, b in rs) for rs in use.layout] == [11, 11, 11]
    assert plan.params["down.weight"].padded == 33


def test_rank_rewrite_inserts_f_and_g_and_adds_the_bias_once_after_g():
    cap = _captured(Block())
    plan = annotate(cap.gm, 2, cap.param_names)
    for r in range(2):
        rg = rewrite_rank(cap.gm, plan, cap.param_names, r)
        calls = [n for n in rg.graph.nodes if n.op == "call_module"]
        assert [n.target for n in calls] == ["f", "g"]
        g_node = calls[1]
        (user,) = g_node.users
        assert user.target == torch.ops.aten.add.Tensor and user.args[1].target == "down.bias"
        assert rg.modules == []          # no collective beyond f and g
        nodes = [n.op for n in rg.graph.nodes]
        assert nodes == [n.op for n in rewrite_rank(cap.gm, plan, cap.param_names, 1 - r).graph.nodes]   # lockstep


def test_every_edit_kind_is_a_row_of_the_edit_table_and_an_unknown_one_is_refused():
    """The rewrite applies edits through passes/rewrite/edits.py's EDITS: every edit class the
    analysis can write has a row; an edit without one names its node instead of being skipped."""
    import dataclasses
    import typing

    from autoshard.passes.rewrite.edits import EDITS
    from autoshard.passes.sharding.placement import NodeSharding
    (edit_union,) = typing.get_args(typing.get_type_hints(NodeSharding)["edits"])    # list[A | B | ...]
    assert set(typing.get_args(edit_union)) == set(EDITS)

    class NewEdit:
        pass
    cap = _captured(Block())
    plan = annotate(cap.gm, 2, cap.param_names)
    up = next(n for n in cap.gm.graph.nodes if n.meta.get("sharding") and any(
        isinstance(e, ColumnInput) for e in n.meta["sharding"].edits))
    up.meta["sharding"] = dataclasses.replace(up.meta["sharding"], edits=[*up.meta["sharding"].edits, NewEdit()])
    with pytest.raises(ShardingError, match=f"node {up.name}: the analysis wrote an edit NewEdit that "
                                            "passes/rewrite/edits.py's EDITS has no row for"):
        rewrite_rank(cap.gm, plan, cap.param_names, 0)


def test_split_stages_cuts_the_layers_evenly_and_sends_only_between_neighbours():
    cap = _captured(Stack(n=4))
    stages = split_stages(cap.gm, 2, cap.param_names)
    assert [s.layers for s in stages] == [range(0, 2), range(2, 4)]
    assert stages[0].receives == [] and len(stages[0].sends) == 1 == len(stages[1].receives)
    reads = [{n.target for n in s.graph.nodes if n.op == "get_attr"} for s in stages]
    assert "head.weight" in reads[1] and "head.weight" not in reads[0]
    assert "layers.0.up.weight" in reads[0] and "layers.0.up.weight" not in reads[1]
    for s in stages:
        s.graph.lint()


def test_split_stages_run_in_sequence_equal_the_whole_graph():
    model = Stack(n=4)
    cap = _captured(model)
    x = torch.randn(2, 5, 8)
    carried: list = []
    for s in split_stages(cap.gm, 4, cap.param_names):
        carried = list(fx.GraphModule(cap.gm, s.graph)(x, *carried))
    torch.testing.assert_close(carried[0], model(x), rtol=1e-6, atol=1e-6)
