"""Sequence parallelism (Korthikanti et al. 2022) on top of tensor parallelism."""
import pytest
import torch

from autoshard import ShardingError, autoshard
from autoshard.testing import grad_errors, max_rel
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
    assert "aten.slice.Tensor(f, 1, 12, 16)" in code          # rank 3 keeps tokens 12..16
    assert "self.gather_tokens_" in code                        # all-gather before column-parallel
    assert "self.f(model_layers_0_input_layernorm_weight)" in code   # norm weight grads summed over tp
    gm = prog.rank(0).graph_module
    rms = [n for n in gm.graph.nodes if "rsqrt" in n.name]
    assert rms, "no RMSNorm found"


def test_other_shapes_compile_again_with_sequence_parallelism():
    model = build_model("gpt2")
    prog = autoshard(model, tp=2, sequence_parallel=True, example_kwargs={"input_ids": torch.randint(0, 128, (2, 16))})
    ids = torch.randint(0, 128, (3, 8))
    assert max_rel(prog.simulate(input_ids=ids).logits, model(input_ids=ids).logits) <= 1e-5
    assert len(prog._compiled) == 2


def test_sequence_not_divisible_by_tp_is_refused():
    with pytest.raises(ShardingError, match="sequence length 15 is not divisible by tp=4"):
        autoshard(build_model("gpt2"), tp=4, sequence_parallel=True,
                  example_kwargs={"input_ids": torch.randint(0, 128, (2, 15))})


def test_sequence_parallel_needs_vocab_parallel():
    with pytest.raises(ShardingError, match="needs vocab_parallel=True"):
        autoshard(build_model("gpt2"), tp=2, sequence_parallel=True, vocab_parallel=False)
