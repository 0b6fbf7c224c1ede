"""precision="fp8" (passes/fp8_linears.py, parallel/fp8_linear.py): the tensor-parallel FP8 program
computes the single-device FP8 program's numbers (the same recipe, the same scales), forward and
gradients, and does not without the tp group's amax; the table of linears that stay bf16.

Tolerances. Around the FP8 matmuls in fp32 (the model in fp32, its linears in float8): 1e-5, the
project's fp32 tolerance. The float8 casts of a shard are the whole tensor's casts element for
element once the scales agree, and _scaled_mm sums in fp32, so the programs differ only in fp32's
summation order (measured: 4e-7 worst gradient). In bf16 the loss agrees within bf16's 1e-2
(measured 1e-7 to 3e-5), but not every gradient: the tp program adds bf16 partial sums (the
row-parallel outputs, the input gradients of the vocabulary-parallel LM head) where one device
rounds once, and a bf16 ulp of difference moves an e5m2 gradient a whole float8 step (a quarter of
its value) wherever it sits near a rounding boundary: 2-8% norm-wise. That is the rounding order,
not the split, which the fp32 comparison checks, as verify compares bf16 programs in float64."""
import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from autoshard import autoshard
from autoshard.errors import ShardingError
from autoshard.parallel.fp8_linear import Fp8Linear
from autoshard.testing.models import build_model

FP32_TOL, BF16_LOSS_TOL = 1e-5, 1e-2


def _llama(ffn: int = 128, layers: int = 2) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=ffn, num_hidden_layers=layers, num_attention_heads=4,
                      num_key_value_heads=2, attention_bias=True, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():                   # biases and norm weights away from their initial values
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.05 * torch.randn_like(p))
        # one output row of a column-parallel weight and one input column of a row-parallel one much
        # larger than the rest: the ranks' own amaxes then differ from the whole tensor's
        model.model.layers[0].mlp.up_proj.weight[ffn - 20] *= 8
        model.model.layers[0].self_attn.o_proj.weight[:, 50] *= 8
    return model.to(torch.bfloat16)


def _run(prog, ids):
    out = prog.simulate(input_ids=ids, labels=ids)
    out.loss.backward()
    return out.loss.detach().float(), prog.full_grads()


def _worst(grads, want) -> float:
    return max((grads[k].float() - g.float()).norm().item() / g.float().norm().item()
               for k, g in want.items() if g is not None and g.norm() > 0)


def _scaling_alone(prog):
    """`prog` with every Fp8Linear scaling by its own rank's amaxes (no tp or cp max): the wrong program
    the comparisons must tell apart."""
    for rank in prog.ranks():
        for m in rank.modules():
            if isinstance(m, Fp8Linear):
                m.reduce = False
    return prog


def _off(grads, want, tol: float) -> list[str]:
    return [k for k, g in want.items() if g is not None and g.norm() > 0
            and (grads[k].float() - g.float()).norm().item() > tol * g.float().norm().item()]


@pytest.mark.parametrize("split", [{}, {"sequence_parallel": True}, {"pp": 2}, {"cp": 2}, {"recompute": "full"},
                                   {"recompute": "selective"}, {"fuse": True, "sequence_parallel": True}],
                         ids=["tp2", "tp2-sp", "tp2-pp2", "cp2-tp2", "tp2-full-recompute", "tp2-selective-recompute",
                              "tp2-sp-fused"])
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_the_tp2_fp8_program_equals_the_single_device_fp8_program(recipe, split):
    """Sequence parallelism gathers a column-parallel linear's tokens before it and reduce-scatters a
    row-parallel one's after it, so each FP8 matmul sees the whole sequence as at tp alone; the
    pipeline cuts between layers; a recomputed region runs its Fp8Linear calls again in backward, their
    scales computed again from the same tensors. At cp=2 each rank holds half the tokens: the amaxes
    over the tokens take the cp group's max too. Fused ops (their torch implementations here) come
    after the FP8 pass, which has already moved each bias after its Fp8Linear (before, fuse=True with
    FP8 was refused as if fusion ran first)."""
    model = _llama().float()
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    kw = dict(example_kwargs={"input_ids": ids, "labels": ids}, precision="fp8", fp8_recipe=recipe)
    loss1, grads1 = _run(autoshard(copy.deepcopy(model), tp=1, **kw), ids)
    plain, _ = _run(autoshard(copy.deepcopy(model), tp=1, example_kwargs=kw["example_kwargs"]), ids)
    assert 1e-5 < abs(loss1 - plain) / plain < 1e-2          # the linears ran in float8, near fp32
    loss2, grads2 = _run(autoshard(copy.deepcopy(model), tp=2, **split, **kw), ids)
    assert abs(loss2 - loss1) / loss1 <= FP32_TOL
    assert _worst(grads2, grads1) <= FP32_TOL, _worst(grads2, grads1)
    # each rank scaling by its own shard's amax: not the single-device model's numbers
    if split:
        return
    _, grads3 = _run(_scaling_alone(autoshard(copy.deepcopy(model), tp=2, **kw)), ids)
    assert _worst(grads3, grads1) > 1e-2, _worst(grads3, grads1)


def test_the_bf16_fp8_programs_loss_agrees_within_bf16s_tolerance():
    model = _llama()
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    kw = dict(example_kwargs={"input_ids": ids, "labels": ids}, precision="fp8")
    loss1, _ = _run(autoshard(copy.deepcopy(model), tp=1, **kw), ids)
    loss2, grads2 = _run(autoshard(copy.deepcopy(model), tp=2, **kw), ids)
    assert abs(loss2 - loss1) / loss1 <= BF16_LOSS_TOL
    assert all(g.dtype == torch.bfloat16 and torch.isfinite(g).all() for g in grads2.values() if g is not None)


def test_the_table_keeps_the_lm_head_and_odd_sizes_in_bf16_and_print_says_so():
    """At tp=4 an MLP of 96 features holds 24 on each rank: not a multiple of 16, so gate, up and
    down stay bf16 (whole, 96 would do). k and v: 2 kv heads of 16 over 4 ranks, a head shared by
    two ranks: bf16 (test_kv_rows_held_by_several_tp_ranks_stay_in_the_models_dtype says why; before
    they ran in FP8 and this test said so)."""
    model = _llama(ffn=96)
    ids = torch.randint(0, 256, (2, 32))
    prog = autoshard(model, tp=4, example_kwargs={"input_ids": ids, "labels": ids}, precision="fp8")
    recipe, table = prog.fp8
    assert recipe == "tensorwise" and table["lm_head.weight"].startswith("the LM head")
    for proj in ("gate_proj", "up_proj", "down_proj"):
        assert "not multiples of 16" in table[f"model.layers.1.mlp.{proj}.weight"]
    for proj in ("q_proj", "o_proj"):
        assert table[f"model.layers.0.self_attn.{proj}.weight"] is None
    for proj in ("k_proj", "v_proj"):
        assert table[f"model.layers.0.self_attn.{proj}.weight"].startswith("rows held by several tp ranks")
    text = str(prog)
    assert "fp8 (tensorwise scaling): 4 of 15 linears run in float8" in text, text
    assert "  lm_head.weight: the LM head" in text


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_gpt2s_conv1d_linears_run_in_fp8_as_on_one_device(recipe):
    """GPT-2's Conv1D is addmm(b, x, w) with w [in, out] (mm once tp's rewrite adds a row-parallel
    bias after g): its weights run in FP8 too, transposed into the Fp8Linear, their tp role read off
    the other dim. Before, none of them did and the table listed only the LM head. On these ids the
    programs agree within 1e-5; on ids seeded 0 one tensorwise e5m2 output-gradient element lands on
    the other side of a rounding step in the tp program's fp32 order, moving 17 of 28 gradients
    by up to 3e-3 (measured; seeds 1-3 agree), as each shard's own amax moves all 28 by 7-13%."""
    torch.manual_seed(0)
    model = build_model("gpt2", layers=2)
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(1))
    kw = dict(example_kwargs={"input_ids": ids, "labels": ids}, precision="fp8", fp8_recipe=recipe)
    one = autoshard(copy.deepcopy(model), tp=1, **kw)
    assert sum(why is None for why in one.fp8[1].values()) == 8, one.fp8        # 4 Conv1D per layer
    loss1, grads1 = _run(one, ids)
    prog = autoshard(copy.deepcopy(model), tp=2, **kw)
    roles = {m.role for rank in prog.ranks() for m in rank.modules() if isinstance(m, Fp8Linear)}
    assert roles == {"column", "row"}, roles
    loss2, grads2 = _run(prog, ids)
    assert abs(loss2 - loss1) / loss1 <= FP32_TOL and _worst(grads2, grads1) <= FP32_TOL
    _, grads4 = _run(autoshard(copy.deepcopy(model), tp=2, fuse=True, **kw), ids)    # the c_fc bias + GeLU fused
    assert _worst(grads4, grads1) <= FP32_TOL
    _, grads3 = _run(_scaling_alone(autoshard(copy.deepcopy(model), tp=2, **kw)), ids)
    assert _worst(grads3, grads1) > 1e-2, _worst(grads3, grads1)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_kv_rows_held_by_several_tp_ranks_stay_in_the_models_dtype(recipe):
    """2 kv heads at tp=4: each k and v row is held by two ranks, whose gradients for it are partial
    sums until their sync; cast to float8 each partial is scaled and rounded on its own, where one
    device casts the sum. Before, k_proj and v_proj ran in FP8 and the tp=4 program missed the
    single-device FP8 model (with the same table) by 10% (tensorwise) and 6.5% (rowwise), measured.
    They stay in the model's dtype, saying why; the program is then the single-device one's."""
    from autoshard.verify.fp8_model import to_fp8_model
    model = _llama().double()
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    prog = autoshard(copy.deepcopy(model), tp=4, example_kwargs={"input_ids": ids, "labels": ids}, precision="fp8",
                     fp8_recipe=recipe)
    table = prog.fp8[1]
    assert table["model.layers.0.self_attn.k_proj.weight"].startswith("rows held by several tp ranks"), table
    assert table["model.layers.0.self_attn.q_proj.weight"] is None
    reference = copy.deepcopy(model)
    to_fp8_model(reference, table, recipe)
    reference(input_ids=ids, labels=ids).loss.backward()
    _, grads = _run(prog, ids)
    assert _worst(grads, {n: p.grad for n, p in reference.named_parameters()}) <= FP32_TOL


def test_falcons_transposed_weights_run_in_fp8_and_a_wide_mlp_is_certified():
    """Falcon reads its weights as `x @ self.weight.T` (aten.matmul of a transpose): before, none of its
    linears ran in FP8 (the table held only the LM head). Its 18176-wide MLP at tp=2 (here in one
    layer) is certified in float64, the float8 products summed there too (in float32, two layers, an
    ulp of summation order moved values across float8 steps and one gradient missed by 2.5%,
    measured: a false NOT VERIFIED)."""
    import transformers as hf

    from autoshard.verify.run import Split, verify_model
    torch.manual_seed(0)
    model = hf.FalconForCausalLM(hf.FalconConfig(vocab_size=128, hidden_size=64, num_attention_heads=4,
                                                 num_hidden_layers=1, ffn_hidden_size=18176))
    cert = verify_model(model, Split(tp=2, precision="fp8"), runtime=False)
    text = cert.render()
    assert cert.passed and "fp8 (tensorwise): 4 of 5 linears in float8" in text, text
    assert "tolerance 1e-02: float64 summation order" in text and max(i.error for i in cert.items) < 1e-5, text


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_without_the_cp_groups_max_a_context_parallel_fp8_program_differs(recipe):
    """At cp=2 (tp=1: no tp group) a rank scaling the tensorwise activations and output gradients, or
    the rowwise grad_w operands, by its own tokens' amax is not the single-device FP8 model: 14 and
    29 of the 29 gradients off by 4-20% (measured). With the cp max, every gradient within 1e-5 but
    at most one, within 1e-3: the ring attention adds the tokens' parts in another fp32 order, and one
    element of one rowwise output gradient then fell on the other side of a float8 rounding step
    (measured 2.6e-4 on layer 1's up_proj at cp=2; none at cp=4 or cp2 x tp2)."""
    model = _llama().float()
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    kw = dict(example_kwargs={"input_ids": ids, "labels": ids}, precision="fp8", fp8_recipe=recipe)
    loss1, grads1 = _run(autoshard(copy.deepcopy(model), tp=1, **kw), ids)
    prog = autoshard(copy.deepcopy(model), tp=1, cp=2, **kw)
    loss2, grads2 = _run(prog, ids)
    assert abs(loss2 - loss1) / loss1 <= FP32_TOL
    off = _off(grads2, grads1, FP32_TOL)
    assert len(off) <= 1 and _worst(grads2, grads1) <= 1e-3, off
    alone = autoshard(copy.deepcopy(model), tp=1, cp=2, **kw)
    assert {m.cp for rank in alone.ranks() for m in rank.modules() if isinstance(m, Fp8Linear)} == {2}
    _, grads3 = _run(_scaling_alone(alone), ids)
    assert len(_off(grads3, grads1, FP32_TOL)) >= 10 and _worst(grads3, grads1) > 1e-2, _worst(grads3, grads1)


def _microbatch_grads(model, table, recipe, ids):
    """The single-device FP8 model (verify/fp8_model.py) on each row of ids alone, its gradients
    averaged over the rows, as dp=2 weighs two equal data ranks."""
    from autoshard.verify.fp8_model import to_fp8_model
    grads: dict = {}
    for b in range(ids.shape[0]):
        ref = copy.deepcopy(model)
        assert to_fp8_model(ref, table, recipe) == []
        (ref(input_ids=ids[b:b + 1], labels=ids[b:b + 1]).loss / ids.shape[0]).backward()
        for n, p in ref.named_parameters():
            if p.grad is not None:
                grads[n] = grads.get(n, 0) + p.grad
    return grads


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_experts_grouped_matmuls_run_in_fp8_as_on_one_device_and_over_ep(recipe):
    """Mixtral's experts run transformers' grouped matmul: the FP8 pass puts fp8_grouped_mm in its place
    (each expert's matmul an FP8 linear with its own scales), and under expert parallelism the model's
    experts module runs it through Fp8GroupedMatmuls, each source rank's tokens a call of their own.
    Checked against the single-device FP8 model (the module's grouped matmuls in float8): at tp=1 on
    the batch, at dp=2 x ep=2 on each microbatch (data rank) alone. Run as one call over both data
    ranks' tokens, an expert's scales span two microbatches: 9% (tensorwise) and 2.7% (rowwise, the
    experts' weight gradients) off, measured. Experts split over tp stay in the model's dtype."""
    from autoshard.parallel.fp8_experts import fp8_grouped_mm
    from autoshard.regions import experts_call
    from autoshard.testing.models import build_moe
    from autoshard.verify.fp8_model import to_fp8_model
    model = build_moe("mixtral")
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(1))
    kw = dict(example_kwargs={"input_ids": ids, "labels": ids}, precision="fp8", fp8_recipe=recipe)
    one = autoshard(copy.deepcopy(model), **kw)
    experts = {k: v for k, v in one.fp8[1].items() if ".experts." in k}
    assert len(experts) == 4 and all(why is None for why in experts.values()), experts
    graph = one.rank(0)._graphs[0][1].graph
    assert sum(n.target is fp8_grouped_mm for n in graph.nodes) == 4
    loss1, grads1 = _run(one, ids)
    ref = copy.deepcopy(model)
    to_fp8_model(ref, one.fp8[1], recipe)
    out = ref(input_ids=ids, labels=ids)
    out.loss.backward()
    assert abs(loss1 - out.loss.detach()) <= FP32_TOL * out.loss.detach()
    assert _worst(grads1, {n: p.grad for n, p in ref.named_parameters()}) <= FP32_TOL

    want = _microbatch_grads(model, one.fp8[1], recipe, ids)
    _, grads2 = _run(autoshard(copy.deepcopy(model), dp=2, ep=2, **kw), ids)
    assert _worst(grads2, want) <= FP32_TOL, _worst(grads2, want)
    whole = experts_call.dispatch_combine
    with pytest.MonkeyPatch.context() as mp:         # every received token in one call
        mp.setattr(experts_call, "dispatch_combine", lambda *a, per_source=False: whole(*a))
        _, grads3 = _run(autoshard(copy.deepcopy(model), dp=2, ep=2, **kw), ids)
    assert _worst(grads3, want) > 1e-2, _worst(grads3, want)

    split = autoshard(copy.deepcopy(model), tp=2, **kw).fp8[1]
    assert split["model.layers.0.mlp.experts.down_proj"].startswith("experts split over tp ranks"), split


def test_an_moe_models_router_stays_in_its_dtype_and_dp2_ep2_fp8_experts_are_certified():
    """Mixtral's router is a module holding its [experts, H] weight, not an nn.Linear: before, with 16
    experts (a multiple of 16) it ran in float8 while the table said routers stay bf16. The FP8 split
    at dp=2 x ep=2, experts included, is certified against the single-device FP8 model (regression:
    the reference's experts were patched through a bound method, so verify's copy of it ran the
    original's weights and its own got no gradient: the runtime's rows raised)."""
    from autoshard.testing.models import build_moe
    from autoshard.verify.run import Split, verify_model
    model = build_moe("mixtral", experts=16)
    ids = torch.randint(0, 100, (2, 16))
    prog = autoshard(copy.deepcopy(model), dp=2, ep=2, example_kwargs={"input_ids": ids}, precision="fp8")
    table = prog.fp8[1]
    assert table["model.layers.0.mlp.gate.weight"].startswith("a router"), table
    assert table["model.layers.1.mlp.experts.down_proj"] is None, table
    # the simulation's exchange; the runtime's rows at dp2 x ep2 are tests/local/test_fp8_runtime.py's
    cert = verify_model(model, Split(dp=2, ep=2, precision="fp8"), runtime=False)
    assert cert.passed, cert.render()
    # what the runtime's rows do with the reference: each rank runs a deep copy of it
    from autoshard.verify.fp8_model import to_fp8_model
    reference = copy.deepcopy(model)
    to_fp8_model(reference, table, "tensorwise")
    again = copy.deepcopy(reference)
    again(input_ids=ids, labels=ids).loss.backward()
    assert again.model.layers[0].mlp.experts.down_proj.grad is not None
    assert "model.layers.1.mlp.experts.down_proj" in cert.render()


def test_bad_fp8_arguments_are_refused():
    model = _llama()
    ids = torch.randint(0, 256, (2, 32))
    with pytest.raises(ShardingError, match="precision='bf16'"):
        autoshard(model, tp=2, example_kwargs={"input_ids": ids}, precision="bf16")
    with pytest.raises(ShardingError, match="fp8_recipe='blockwise'"):
        autoshard(model, tp=2, example_kwargs={"input_ids": ids}, precision="fp8", fp8_recipe="blockwise")


def test_verify_certifies_an_fp8_split_and_fails_one_that_scales_shards_alone(monkeypatch):
    """`autoshard verify --precision fp8` (verify_model with precision in the split): compared with
    the single-device FP8 model (its nn.Linear modules swapped for float8 ones, verify/fp8_model.py)
    in float32; the certificate names the FP8 linears. A program whose ranks scale by their own
    shard's amax (the tp max turned off in every Fp8Linear built) is not certified."""
    from autoshard.parallel.fp8_linear import Fp8LinearSpec
    from autoshard.verify.run import Split, verify_model
    model = _llama()
    cert = verify_model(model, Split(tp=2, precision="fp8", fp8_recipe="rowwise"), runtime=False)
    assert cert.passed, cert.render()
    text = cert.render()
    assert "fp8 (rowwise): 14 of 15 linears in float8" in text and "model.layers.1.mlp.down_proj.weight" in text
    assert "lm_head.weight stays in the model's dtype: the LM head" in text
    build = Fp8LinearSpec.build
    monkeypatch.setattr(Fp8LinearSpec, "build", lambda self, handle, cp_handle: build(
        Fp8LinearSpec(self.module, self.recipe, self.role, self.cp, reduce=False), handle, cp_handle))
    bad = verify_model(model, Split(tp=2, precision="fp8", fp8_recipe="rowwise"), runtime=False)
    assert not bad.passed


def test_the_verify_command_certifies_fp8_over_data_parallel_ranks_per_microbatch(capsys):
    """`autoshard verify --precision fp8` at tp=2 x dp=2: each data rank's scales are its microbatch's,
    so the single-device FP8 model is run on the same microbatches and its losses added as the
    runtime adds them (verify/compare.py's microbatch_reference; against the whole batch at once it
    missed by 0.33), and each step starts from the same weights on both sides (before, after two
    AdamW steps the runs had parted: 0.10 at step 3, in the simulation and in the runtime alike)."""
    from autoshard.verify.command import main
    small = ["--model", "llama", "--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "2", "--vocab", "128",
             "--max-positions", "64", "--tp", "2"]
    assert main([*small, "--dp", "2", "--precision", "fp8"]) == 0
    out = capsys.readouterr().out
    assert out.strip().splitlines()[-1].startswith("VERIFIED") and "fp8 (tensorwise): " in out, out
    assert "tolerance 1e-02: float64 summation order" in out and "on the same microbatches" in out, out
    assert "the runtime, 4 ranks on a local world" in out, out
    assert main([*small, "--fp8-recipe", "rowwise"]) == 2
    assert "--fp8-recipe rowwise: a recipe for --precision fp8" in capsys.readouterr().err
