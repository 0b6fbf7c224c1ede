"""Expert parallelism's compile, in one process: each experts call outlined into one module
(passes/outline_experts.py), the module's expert-parallel path (the model's own experts code on received
tokens, regions/experts_call.py) against the exported graph, and the refusals. Training on real
processes is tests/distributed/test_expert_parallel.py."""
import copy

import pytest
import torch

from autoshard import autoshard
from autoshard.errors import ShardingError
from autoshard.parallel import expert_parallel
from autoshard.parallel.comm import SIMULATED
from autoshard.parallel.expert_parallel import dispatch_combine
from autoshard.testing import grad_errors, max_rel
from autoshard.testing.current_models import build_current
from autoshard.testing.metrics import scaled_errors
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
    """Simulated at ep=2, each call dispatches, runs the model's experts module on the received rows
    with its parameters, and combines: the loss (per token over both slices, -100 labels unevenly
    spread), logits and gradients equal the model's, on a new shape too; the exported graph never runs."""
    model = build_moe(name)
    model.config._experts_implementation = impl
    prog = autoshard(model, dp=2, ep=2, example_kwargs=_call())
    call = _call(rows=4, seq=12, seed=2)                    # a new shape as well
    call["labels"][1, :9] = -100                            # slice 0 counts fewer tokens than slice 1
    prog.simulate(**call)
    ran = []
    for rank in prog._replicas().ranks():                  # the exported graph must not run
        assert all(c.ep is not None for c in rank.expert_calls())
        for c in rank.expert_calls():
            c.body.register_forward_pre_hook(lambda *a: ran.append(1))
    out, ref = prog.simulate(**call), model(**call)
    assert not ran
    assert max_rel(out.logits, ref.logits) <= 1e-5 and max_rel(out.loss, ref.loss) <= 1e-6
    out.loss.backward()
    ref.loss.backward()
    errs = grad_errors(prog.full_grads(), {n: p.grad for n, p in model.named_parameters()})
    assert max(errs.values()) <= 1e-5, errs


def test_each_expert_parallel_rank_is_cut_with_only_its_experts():
    """The experts are cut at compile time, next to the tp shards (before: every rank was built with
    all experts and cut at run time): prog.rank(t, ep_rank=e) holds experts e*per .. e*per+per-1 of
    each layer and the same tp shards as prog.rank(t) elsewhere; weights loaded with
    prog.load_state_dict reach the ranks built before and after the load."""
    model = build_moe("mixtral")
    prog = autoshard(model, tp=2, dp=2, ep=2, example_kwargs=_call())
    per = prog.experts_per_rank
    assert per == model.config.num_local_experts // 2
    for t in range(2):
        whole = dict(prog.rank(t).named_parameters())
        for e in range(2):
            rank = prog.rank(t, ep_rank=e)
            assert rank.expert_group.rank == e and rank.expert_params is prog.expert_params
            for name, p in rank.named_parameters():
                want = whole[name].narrow(0, e * per, per) if name in prog.expert_params else whole[name]
                assert torch.equal(p, want), name
    built = prog.rank(1, ep_rank=1)
    state = {n: torch.randn_like(p) for n, p in model.named_parameters()}
    fresh = autoshard(build_moe("mixtral"), tp=2, dp=2, ep=2, example_kwargs=_call())
    early = fresh.rank(1, ep_rank=1)
    fresh.load_state_dict(state, strict=False)
    full = fresh.full_state_dict()                          # from its tp ranks, built after the load
    assert all(torch.equal(full[n], state[n]) for n in state)
    for rank in (early, fresh.rank(0, ep_rank=1)):
        whole = dict(fresh.rank(rank.rank).named_parameters())
        for name, p in rank.named_parameters():
            want = whole[name].narrow(0, per, per) if name in prog.expert_params else whole[name]
            assert torch.equal(p, want), name
    assert built is prog.rank(1, ep_rank=1)
    with pytest.raises(IndexError, match="ep_rank 2 out of range for ep=2"):
        prog.rank(0, ep_rank=2)
    dense = autoshard(build_moe("mixtral"), tp=2, example_kwargs=_call())
    with pytest.raises(ShardingError, match="ep_rank=0: this program has no expert parallelism"):
        dense.rank(0, ep_rank=0)


def test_dispatch_combine_sums_each_tokens_weighted_experts():
    torch.manual_seed(0)
    x, w = torch.randn(5, 3), torch.rand(5, 2)
    idx = torch.tensor([[0, 3], [2, 1], [3, 3], [1, 0], [2, 0]])
    scale = torch.tensor([1.0, 2.0, 3.0, 4.0])                  # expert e multiplies by scale[e]
    out, = dispatch_combine(SIMULATED, [x], [idx], [w], [lambda xs, ids, ws: xs * scale[ids] * ws], 4, 1)
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


def _ep_check(name: str, ep: int, tp: int) -> tuple[float, float]:
    """prog.simulate() at ep (with tp) against the model: logits, and gradients of a loss on them."""
    model, ref = build_moe(name), build_moe(name)
    prog = autoshard(model, tp=tp, dp=ep, ep=ep, example_kwargs={"input_ids": _call()["input_ids"]})
    ids = _call(rows=2 * ep, seed=3)["input_ids"]
    out, want = prog.simulate(input_ids=ids), ref(input_ids=ids)
    probe = torch.randn(want.logits.shape, generator=torch.Generator().manual_seed(5))
    (out.logits * probe).sum().backward()
    (want.logits * probe).sum().backward()
    errs = scaled_errors(prog.full_grads(), {n: p.grad for n, p in ref.named_parameters()})
    return max_rel(out.logits, want.logits), max(errs.values())


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe", "olmoe"])
@pytest.mark.parametrize("ep", [2, 4])
def test_simulate_runs_expert_parallelism_with_tensor_parallelism(name, ep):
    """ep x tp=2 ranks in one process, each expert-parallel rank on its slice of the batch, tokens
    exchanged by the simulator's all-to-all (before: simulate() ran every ep program as ep=1)."""
    logits, grads = _ep_check(name, ep, tp=2)
    assert logits <= 1e-5 and grads <= 1e-4, (logits, grads)


@pytest.mark.parametrize("tp,ep", [(1, 2), (2, 2)])
def test_experts_over_every_experts_copy_of_the_tokens(tp, ep):
    """Llama 4's experts read every expert's copy of the tokens ([experts * n, H], scaled by the
    router before, summed after, outside the module): each owner receives its experts' copies from
    every rank and sends them back. Before: "Llama4ForCausalLM has no experts module expert
    parallelism knows". At tp=2 the export puts g after the sum over the copies, so the call
    returns partial sums (reducing them inside as well was a 0.046 error in the logits)."""
    model = build_current("Llama4")
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    ref = copy.deepcopy(model)
    prog = autoshard(model, tp=tp, dp=ep, ep=ep, example_kwargs=_call())
    assert prog.expert_params == {f"model.layers.{i}.feed_forward.experts.{p}" for i in range(2)
                                  for p in ("gate_up_proj", "down_proj")}
    call = _call(rows=2 * ep, seq=12, seed=3)
    call["labels"][1, :7] = -100
    out, want = prog.simulate(**call), ref(**call)
    assert max_rel(out.logits, want.logits) <= 1e-5 and max_rel(out.loss, want.loss) <= 1e-6
    out.loss.backward()
    want.loss.backward()
    errs = scaled_errors(prog.full_grads(), {n: p.grad for n, p in ref.named_parameters()})
    assert max(errs.values()) <= 1e-5, max(errs.items(), key=lambda kv: kv[1])


def test_a_bias_added_after_the_experts_reduction_counts_once_at_tp_x_ep():
    """Regression: gpt-oss's down_proj_bias (added after g in the exported region) was added by the
    model's own experts module on every tp rank of an expert-parallel rank, then summed by g: counted
    tp times. At its initial 0 nothing showed; after one step of training the loss was off 5e-5 to
    6e-4 (gpt-oss, tp=2 x dp=2 x ep=2, on gloo and in simulation)."""
    model = build_current("GptOss")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("_bias"):
                p.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(1))
    ref = copy.deepcopy(model)
    call = _call(rows=4, seed=3)
    prog = autoshard(model, tp=2, dp=2, ep=2, example_kwargs=_call())
    call["labels"][:, 0] = -100
    out, want = prog.simulate(**call), ref(**call)
    assert max_rel(out.logits, want.logits) <= 1e-5
    out.loss.backward()
    want.loss.backward()
    errs = scaled_errors(prog.full_grads(), {n: p.grad for n, p in ref.named_parameters()})
    assert max(errs.values()) <= 1e-4, max(errs.items(), key=lambda kv: kv[1])


def test_a_token_sent_to_the_wrong_owner_is_caught(monkeypatch):
    """Mutation: the dispatch sends the first (token, slot) pair to the next rank's copy of its
    expert; the simulated check must fail (the logits move), so it does test the exchange."""
    right = expert_parallel.owner_of

    def wrong(flat, per_rank):
        owner = right(flat, per_rank)
        return torch.cat([(owner[:1] + 1) % 2, owner[1:]])
    monkeypatch.setattr(expert_parallel, "owner_of", wrong)
    try:
        logits, _ = _ep_check("mixtral", 2, tp=1)
    except (RuntimeError, IndexError):       # a local expert id out of range on the receiving rank
        return
    # the check the real test makes fails: the logits moved, or are NaN (that out-of-range id read
    # whatever lay past the local experts; NaN <= 1e-5 is False, as the real test reads it)
    assert not logits <= 1e-5, logits
