"""Dynamic batch/sequence sizes, re-specialization, meta-device compile, inferred inputs."""
import operator

import pytest
import torch
from torch import nn

from autoshard import autoshard
from autoshard.testing import build_model, max_rel
from autoshard.testing.models import VOCAB


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_other_batch_and_sequence_sizes_reuse_the_graph(name):
    model = build_model(name)
    prog = autoshard(model, tp=2, example_kwargs={"input_ids": torch.randint(0, VOCAB, (2, 8))})
    for shape in [(1 + 2, 5), (4, 17), (2, 33)]:
        ids = torch.randint(0, VOCAB, shape)
        assert max_rel(prog.simulate(input_ids=ids).logits, model(input_ids=ids).logits) <= 1e-5
    assert len(prog._compiler.compiled) == 1     # batch and sequence were exported dynamic


def test_a_specialized_size_compiles_again_transparently():
    model = build_model("nanogpt")
    prog = autoshard(model, tp=2, example_inputs=(torch.randint(0, VOCAB, (2, 8)),))
    ids = torch.randint(0, VOCAB, (1, 8))      # export's dynamic dims start at 2: batch 1 is new
    assert max_rel(prog.simulate(ids)[0], model(ids)[0]) <= 1e-5
    assert len(prog._compiler.compiled) == 2
    assert len(prog.rank(0)._graphs) == 2


def test_example_inputs_that_alias_each_other_capture_as_separate_inputs():
    """One tensor passed as both idx and targets, or two overlapping views of one batch (the
    usual data[:, :-1], data[:, 1:]), must still give a program with two independent inputs."""
    model = build_model("nanogpt")
    data = torch.randint(0, VOCAB, (2, 9))
    ids, targets = torch.randint(0, VOCAB, (2, 8)), torch.randint(0, VOCAB, (2, 8))
    want = model(ids, targets)[1]
    for example in [(data[:, :-1], data[:, :-1]), (data[:, :-1], data[:, 1:])]:
        prog = autoshard(model, tp=2, example_inputs=example)
        assert max_rel(prog.simulate(ids, targets)[1], want) <= 1e-5


def test_meta_device_model_compiles_without_materializing():
    with torch.device("meta"):
        model = build_model("llama", layers=2)
    prog = autoshard(model, tp=4)
    p = prog.rank(3).get_parameter("model.layers.0.self_attn.q_proj.weight")
    assert p.is_meta and tuple(p.shape) == (16, 64)


@pytest.mark.parametrize("name", ["nanogpt", "gpt2", "bert"])
def test_inputs_inferred_when_not_given(name):
    model = build_model(name)
    prog = autoshard(model, tp=2)
    assert prog.sharding.params


class _SizeArithmetic(nn.Module):
    """b * s computed from the input's symbolic sizes (an operator.mul node on SymInts in the graph,
    as Bloom's and MPT's alibi and Mixture-of-Experts routing write it), around an MLP."""
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x):
        b, s, _ = x.shape
        flat = torch.relu(self.up(x)).reshape(b * s, 16)          # [b * s, 16]
        return self.down(flat).view(b, s, 8)


def test_size_arithmetic_is_not_taken_for_a_tensor_op():
    """operator.mul on sizes is not aten's mul: it was given the element-wise rule and crashed."""
    from autoshard.passes.graph_reading import op_name
    assert op_name(operator.mul) == "operator.mul" and op_name(operator.getitem) == "getitem"
    model = _SizeArithmetic()
    x = torch.randn(2, 5, 8)
    prog = autoshard(model, tp=2, example_inputs=(x,))
    gm = prog.rank(0).graph_module
    assert any(n.target is operator.mul for n in gm.graph.nodes)
    assert set(prog.sharding.params) == {"up.weight", "up.bias", "down.weight"}
    x2 = torch.randn(3, 7, 8)                     # other sizes: the arithmetic runs on them
    assert max_rel(prog.simulate(x2), model(x2)) <= 1e-5
