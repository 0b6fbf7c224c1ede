"""Bad input gets a clear error; what cannot be sharded runs replicated and correct."""
import re

import pytest
import torch
from torch import nn

from autoshard import CaptureError, ShardingError, autoshard
from autoshard.testing import build_model, max_rel


@pytest.mark.parametrize("tp", [0, -2, 1.5, True])
def test_tp_must_be_a_positive_integer(tp):
    with pytest.raises(ShardingError, match="tp must be a positive integer"):
        autoshard(build_model("nanogpt"), tp=tp)


def test_tp_not_dividing_heads_names_module_node_and_numbers():
    # 6 heads of 8 over 4 ranks
    with pytest.raises(ShardingError) as e:
        autoshard(build_model("nanogpt", heads=6, hidden=48), tp=4)
    msg = str(e.value)
    assert "tp=4" in msg and "6 blocks of 8" in msg and "h.0.attn" in msg and "node view" in msg


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_fewer_query_heads_than_ranks_is_refused(name):
    with pytest.raises(ShardingError, match=r"tp=8 cannot split the input of node .*(c_proj|o_proj).*divisible by tp=8"):
        autoshard(build_model(name, heads=4, kv_heads=4), tp=8)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_fewer_query_heads_than_ranks_are_refused_naming_their_projections(attention):
    """2 query heads at tp=4: each head would be shared by two ranks, so the output projection's
    row-parallel sum would count it twice. The refusal names where the heads come from."""
    model = build_model("llama", heads=2, kv_heads=2)
    model.config._attn_implementation = attention
    with pytest.raises(ShardingError) as e:
        autoshard(model, tp=4)
    msg = str(e.value)
    assert "tp=4" in msg and "64 features" in msg and "o_proj" in msg and "q_proj" in msg


class _Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        if x.sum() > 0:            # data-dependent control flow: neither tracer can follow it
            return self.lin(x)
        return x


def test_untraceable_model_shows_the_tracers_reason():
    with pytest.raises(CaptureError, match="torch.export could not trace _Branchy: .*data-dependent") as e:
        autoshard(_Branchy(), tp=2, example_inputs=(torch.randn(2, 8),))
    # the line that branches, in which module, and what to change (before: the tracer's first line only)
    assert re.search(r"test_errors.py:\d+ `if x.sum\(\) > 0:", str(e.value)) and "in <top> (_Branchy.forward)" in str(e.value)
    assert "does not depend on tensor values" in str(e.value)


def test_missing_example_inputs_are_asked_for():
    with pytest.raises(CaptureError, match="pass example_inputs"):
        autoshard(_Branchy(), tp=2)


def test_inputs_not_matching_forward_are_refused():
    with pytest.raises(CaptureError, match="inputs do not match"):
        autoshard(build_model("nanogpt"), tp=2, example_kwargs={"tokens": torch.zeros(2, 4, dtype=torch.long)})


class _NoMatmul(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.scale = nn.Parameter(torch.randn(16))

    def forward(self, x):
        return torch.softmax(self.norm(x) * self.scale, dim=-1)


@pytest.mark.simulation
def test_model_without_parameter_matmuls_runs_replicated_and_correct():
    model = _NoMatmul()
    x = torch.randn(3, 5, 16)
    prog = autoshard(model, tp=2, example_inputs=(x,))
    assert not prog.sharding.params
    out = prog.simulate(x)
    assert max_rel(out, model(x)) <= 1e-6
    out.sum().backward()
    model(x).sum().backward()
    for n, g in prog.full_grads().items():
        assert max_rel(g, model.get_parameter(n).grad) <= 1e-5


def test_rank_out_of_range():
    prog = autoshard(build_model("nanogpt"), tp=2)
    with pytest.raises(IndexError, match="rank 2 out of range for world size 2"):
        prog.rank(2)


def test_running_a_rank_without_a_process_group_says_how():
    prog = autoshard(build_model("nanogpt"), tp=2)
    with pytest.raises(RuntimeError, match="no process group: run it with prog.distributed"):
        prog.rank(0)(torch.randint(0, 128, (2, 8)))


@pytest.mark.simulation
def test_a_bare_tensor_is_the_one_example_input():
    # before: "Boolean value of Tensor with more than one value is ambiguous"
    model = build_model("nanogpt")
    ids = torch.randint(0, 128, (2, 16))
    prog = autoshard(model, tp=2, example_inputs=ids)
    assert max_rel(prog.simulate(ids)[0], model(ids)[0]) <= 1e-5
    with pytest.raises(ShardingError, match="example_inputs must be a tuple .* got dict"):
        autoshard(model, tp=2, example_inputs={"idx": ids})


@pytest.mark.parametrize("name,value", [("virtual", 0), ("pp", 0), ("dp", -1), ("microbatches", 0), ("virtual", 1.5)])
def test_every_split_must_be_a_positive_integer(name, value):
    # before: virtual=0 said "action F0 is out of range"
    with pytest.raises(ShardingError, match=f"{name} must be a positive integer, got {value!r}"):
        autoshard(build_model("nanogpt"), **{name: value})


class _OptionalFeatures(nn.Module):
    """Optional input features go through their own MLP (split when they are given)."""

    def __init__(self):
        super().__init__()
        self.emb, self.up, self.down, self.head = nn.Embedding(128, 32), nn.Linear(16, 64), nn.Linear(64, 32), nn.Linear(32, 128)

    def forward(self, ids, feats=None):
        x = self.emb(ids)
        if feats is not None:
            x = x + self.down(self.up(feats).relu())
        return self.head(x)


@pytest.mark.simulation
def test_an_input_that_changes_what_is_sharded_is_named():
    # before: "inputs of a new shape shard the parameters differently" naming nothing
    model = _OptionalFeatures()
    ids, feats = torch.randint(0, 128, (2, 16)), torch.randn(2, 16, 16)
    prog = autoshard(model, tp=2, example_inputs=(ids,))
    with pytest.raises(ShardingError, match=r"feats given here, not at compile time.*parameter down\.weight"):
        prog.simulate(ids, feats)
    both = autoshard(model, tp=2, example_inputs=(ids, feats))     # the other way round is fine: the
    assert max_rel(both.simulate(ids), model(ids)) <= 1e-5           # call without feats reads none of them
    assert max_rel(both.simulate(ids, feats), model(ids, feats)) <= 1e-5


@pytest.mark.simulation
def test_bert_without_token_type_ids_after_compiling_with_them():
    # before: token types (2 rows) were split like a vocabulary when given, so leaving them out
    # later was refused; now only the first input's table (the words) is vocabulary-parallel
    model = build_model("bert")
    ids = torch.randint(0, 128, (2, 16))
    prog = autoshard(model, tp=2, example_kwargs=dict(input_ids=ids, token_type_ids=torch.zeros_like(ids)))
    assert "bert.embeddings.token_type_embeddings.weight" not in prog.sharding.params
    assert max_rel(prog.simulate(input_ids=ids).logits, model(input_ids=ids).logits) <= 1e-5
