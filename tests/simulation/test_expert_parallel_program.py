"""Expert parallelism's compile, in one process: each experts call outlined into one module
(passes/experts.py), the module's expert-parallel path (the model's own experts code on received
tokens, compile/experts.py) against the exported graph, and the refusals. Training on real
processes is tests/distributed/test_expert_parallel.py."""
import pytest
import torch

from autoshard import autoshard
from autoshard.errors import ShardingError
from autoshard.parallel.expert_parallel import ExpertGroup, dispatch_combine
from autoshard.testing import grad_errors, max_rel
from autoshard.testing.models import VOCAB, build_model, build_moe


def _call(rows: int = 2, seq: int = 16, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (rows, seq), generator=gen)
    labels = torch.randint(0, VOCAB, (rows, seq), generator=gen)
    labels[0, :4] = -100
    return {"input_ids": ids, "labels": labels}


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe", "olmoe"])
def test_each_experts_call_is_one_module_and_the_graph_is_unchanged(name):
    model = build_moe(name)
    prog = autoshard(model, dp=2, ep=2, example_kwargs=_call())
    calls = prog.rank(0).expert_calls()
    assert [c.region.path for c in calls] == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    assert prog.expert_params == {f"model.layers.{i}.mlp.experts.{p}" for i in range(2)
                                  for p in ("gate_up_proj", "down_proj")}
    code = prog.rank(0).code
    assert "self.experts_model_layers_1_mlp_experts(" in code and "grouped_mm_fallback" not in code
    assert "experts over ep=2" in str(prog) and "(ep=2)" in str(prog)
    call = _call(seed=1)
    out, ref = prog.simulate(**call), model(**call)     # unbound: the exported graph
    assert max_rel(out.logits, ref.logits) <= 1e-6


@pytest.mark.parametrize("name, impl", [("mixtral", "grouped_mm"), ("olmoe", "grouped_mm"), ("mixtral", "batched_mm")])
def test_the_expert_parallel_path_equals_the_model(name, impl):
    """Bound to a group of one rank, each call dispatches, runs the model's experts module on the
    received rows with its parameters, and combines: outputs and gradients equal the model's."""
    model = build_moe(name)
    model.config._experts_implementation = impl
    prog = autoshard(model, dp=2, ep=2, example_kwargs=_call())
    rank = prog.rank(0)
    rank.bind_experts(ExpertGroup(None, 0, 1, 4))
    ran = []
    for c in rank.expert_calls():           # the exported graph must not run
        c.body.register_forward_pre_hook(lambda *a: ran.append(1))
    call = _call(rows=3, seq=12, seed=2)                    # a new shape as well
    out, ref = prog.simulate(**call), model(**call)
    assert not ran and all(c.ep is not None for c in rank.expert_calls())
    assert max_rel(out.logits, ref.logits) <= 1e-5
    out.loss.backward()
    ref.loss.backward()
    errs = grad_errors(prog.full_grads(), {n: p.grad for n, p in model.named_parameters()})
    assert max(errs.values()) <= 1e-5, errs


def test_dispatch_combine_sums_each_tokens_weighted_experts():
    torch.manual_seed(0)
    x, w = torch.randn(5, 3), torch.rand(5, 2)
    idx = torch.tensor([[0, 3], [2, 1], [3, 3], [1, 0], [2, 0]])
    scale = torch.tensor([1.0, 2.0, 3.0, 4.0])                  # expert e multiplies by scale[e]
    out = dispatch_combine(x, idx, w, lambda xs, ids, ws: xs * scale[ids] * ws, ExpertGroup(None, 0, 1, 4))
    want = sum(x * scale[idx[:, j], None] * w[:, j, None] for j in range(2))
    assert torch.allclose(out, want)


def test_refusals_name_the_numbers():
    moe, call = build_moe("mixtral"), _call()
    with pytest.raises(ShardingError, match="ep=2 must divide dp=3"):
        autoshard(moe, dp=3, ep=2, example_kwargs=call)
    with pytest.raises(ShardingError, match="4 experts cannot be divided over ep=3"):
        autoshard(moe, dp=3, ep=3, example_kwargs=call)
    with pytest.raises(ShardingError, match="LlamaForCausalLM has no experts module"):
        autoshard(build_model("llama"), dp=2, ep=2, example_kwargs=call)
    with pytest.raises(ShardingError, match="sequence_parallel=True"):
        autoshard(moe, tp=2, dp=2, ep=2, sequence_parallel=True, example_kwargs=call)
    with pytest.raises(ShardingError, match="ep=2"):
        autoshard(moe, world_size=2, ep=2, example_kwargs=call)


@pytest.mark.parametrize("ep", [1, 2])
def test_pipeline_stages_with_full_recompute_receive_only_tensors(ep):
    """The size arithmetic HF's experts do (2 * batch * seq, from the input's sizes) stays outside
    recomputed layers, so each stage recomputes it. Before: layer 0's region returned it and stage 1
    received ['mul_35', 'mul_36', 'add_8']; sending the two ints crashed the pipeline on gloo
    ('int' object has no attribute 'detach')."""
    prog = autoshard(build_moe("mixtral"), dp=2, ep=ep, pp=2, microbatches=2, recompute="full", example_kwargs=_call())
    captured = {n.name: n for n in prog._compiler.compiled[0].captured.gm.graph.nodes}
    stage1 = prog.stage_graphs(prog.rank(0).graph_module)[1]
    assert stage1.receives and all(isinstance(captured[name].meta["val"], torch.Tensor) for name in stage1.receives)
    call = _call(seed=4)
    assert max_rel(prog.simulate(**call).loss, prog.model(**call).loss) <= 1e-6
