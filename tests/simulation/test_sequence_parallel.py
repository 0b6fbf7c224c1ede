"""Sequence parallelism (Korthikanti et al. 2022) on top of tensor parallelism."""
import pytest
import torch

from autoshard import ShardingError, autoshard
from autoshard.testing import grad_errors, max_rel
from autoshard.testing.context_models import build_context, context_batch
from autoshard.testing.models import build_model, input_name, label_name, logits_of


def _loss(out):
    return out[1] if isinstance(out, tuple) else out.loss


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name", ["nanogpt", "gpt2", "llama", "bert"])
def test_sequence_parallel_matches_single_device(name, tp):
    model = build_model(name)
    ids, labels = torch.randint(0, 128, (2, 16)), torch.randint(0, 128, (2, 16))
    kw = {input_name(name): ids, label_name(name): labels}
    ref = model(**kw)
    _loss(ref).backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    prog = autoshard(model, tp=tp, example_kwargs=kw, sequence_parallel=True)
    out = prog.simulate(**kw)
    assert max_rel(_loss(out), _loss(ref)) <= 1e-5
    assert max_rel(logits_of(out), logits_of(ref)) <= 1e-5
    _loss(out).backward()
    assert max(grad_errors(prog.full_grads(), ref_grads).values()) <= 1e-4


def test_norms_and_residuals_run_on_local_tokens():
    prog = autoshard(build_model("llama", layers=1), tp=4, sequence_parallel=True,
                     example_kwargs={"input_ids": torch.randint(0, 128, (2, 16))})
    code = prog.rank(3).code
    assert "self.reduce_scatter_to_sequence_embedding(" in code          # embedding: RS, not g
    assert "self.gather_from_sequence_" in code                          # before column-parallel
    assert "self.reduce_scatter_to_sequence_linear_3(" in code           # o_proj ends with RS
    assert "self.f(model_layers_0_input_layernorm_weight)" in code       # norm grads summed over tp
    assert "self.g(" not in code and "self.f(gather" not in code         # no all-reduces on activations
    module = prog.rank(3).get_submodule("reduce_scatter_to_sequence_embedding")
    assert module.dim == 1 and module.outer == 1


class _Counting:
    """Counts ring-equivalent bytes: all-reduce moves 2x, reduce-scatter and all-gather 1x, of the
    full tensor times (tp-1)/tp. Values are not the model's (no peers); the calls and sizes are.
    Activations (batch x tokens x ...) and parameter-sized tensors are counted apart."""

    def __init__(self, tp, tokens_per_rank):
        self.tp, self.unit = tp, tokens_per_rank
        self.moved = {"activations": 0.0, "parameters": 0.0}

    def _count(self, full, factor):
        kind = "activations" if full.numel() % self.unit == 0 else "parameters"
        self.moved[kind] += factor * full.nbytes * (self.tp - 1) / self.tp

    def all_reduce(self, t):
        self._count(t, 2)
        return t.clone()

    all_reduce_max = all_reduce

    def reduce_scatter(self, t, dim):
        self._count(t, 1)
        return t.chunk(self.tp, dim)[0].clone()

    def all_gather(self, t, dim):
        full = torch.cat([t] * self.tp, dim)
        self._count(full, 1)
        return full


@pytest.mark.parametrize("name", ["nanogpt", "llama"])
def test_same_activation_traffic_as_plain_tensor_parallelism(name):
    batch, seq, tp = 3, 16, 4          # odd batch: activation sizes are multiples of 3*16/4, weights not
    ids, labels = torch.randint(0, 128, (batch, seq)), torch.randint(0, 128, (batch, seq))
    kw = {input_name(name): ids, label_name(name): labels}
    moved = {}
    for sp in (False, True):
        prog = autoshard(build_model(name, layers=2, hidden=64), tp=tp, example_kwargs=kw, sequence_parallel=sp)
        comm = _Counting(tp, batch * seq // tp)
        rank = prog.rank(0).bind(comm)
        _loss(rank(**kw)).backward()
        moved[sp] = comm.moved
    # every all-reduce of activations became a reduce-scatter plus an all-gather: the same bytes
    assert moved[True]["activations"] == pytest.approx(moved[False]["activations"], rel=1e-9), moved
    # what sequence parallelism adds is gradient sums of weights read on token shards (norms,
    # row-parallel biases, and, for learned positions, the position table), as in Megatron;
    # plain tp already sums shared kv-head weights (Llama here: 2 kv heads over 4 ranks)
    extra = moved[True]["parameters"] - moved[False]["parameters"]
    assert 0 < extra < 0.1 * moved[True]["activations"], moved


def test_other_shapes_compile_again_with_sequence_parallelism():
    model = build_model("gpt2")
    prog = autoshard(model, tp=2, sequence_parallel=True, example_kwargs={"input_ids": torch.randint(0, 128, (2, 16))})
    ids = torch.randint(0, 128, (3, 8))
    assert max_rel(prog.simulate(input_ids=ids).logits, model(input_ids=ids).logits) <= 1e-5
    assert len(prog._compiler.compiled) == 2


def test_sequence_not_divisible_by_tp_is_refused():
    with pytest.raises(ShardingError, match="sequence length 15 is not divisible by tp=4"):
        autoshard(build_model("gpt2"), tp=4, sequence_parallel=True,
                  example_kwargs={"input_ids": torch.randint(0, 128, (2, 15))})


def test_sequence_parallel_needs_vocab_parallel():
    with pytest.raises(ShardingError, match="needs vocab_parallel=True"):
        autoshard(build_model("gpt2"), tp=2, sequence_parallel=True, vocab_parallel=False)


def test_an_in_place_add_of_two_reduce_scatters():
    """Falcon's parallel attention adds the MLP's reduce-scattered output into the attention's in place
    (add_): the collective's outputs are tensors of their own, not views autograd refuses to update."""
    batch = context_batch()
    model = build_context("falcon")
    out = model(**batch)
    out.loss.backward()
    prog = autoshard(build_context("falcon"), example_kwargs=batch, tp=2, sequence_parallel=True)
    assert "add_.Tensor(reduce_scatter_to_sequence" in prog.rank(0).code
    got = prog.simulate(**batch)
    assert max_rel(got.logits, out.logits) <= 1e-5
    got.loss.backward()
    assert max(grad_errors(prog.full_grads(), {n: p.grad for n, p in model.named_parameters()}).values()) <= 1e-5


@pytest.mark.timeout(120)
def test_a_moe_whose_experts_index_the_sequence_shards_is_refused_not_analysed_forever():
    """Regression: Mixtral with sequence parallelism never finished compiling (over 10 minutes): the
    experts index the tokens, which sequence parallelism shards, and leaving the region whole did not
    undo that shard, so the analysis met the same node again and again (26,000 times in 40 s)."""
    from autoshard.testing.models import build_moe
    ids = torch.randint(0, 128, (2, 16))
    with pytest.raises(ShardingError, match=r"model\.layers\.0\.mlp\.experts .*compile without sequence_parallel"):
        autoshard(build_moe("mixtral"), tp=2, sequence_parallel=True, example_kwargs={"input_ids": ids, "labels": ids})
