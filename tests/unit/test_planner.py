"""The planner: legal splits only, fastest first; autoshard(model, world_size=N) compiles its choice."""
import functools
import warnings

import pytest
import torch

from autoshard import ShardingError, autoshard
from autoshard.models import GPT, GPTConfig
from autoshard.planning.costmodel import estimate
from autoshard.planning.planner import ModelShape, explain, plan, shape_of
from autoshard.testing.models import build_model

GPT76B = ModelShape(hidden=10240, layers=60, heads=80, vocab=51200, seq=2048)   # Table 1, 76.1B


@functools.cache
def _plans_76b() -> list:
    """The planner's search for the paper's 76B on 1024 GPUs (two tests read it: searched once)."""
    return plan(GPT76B, gpus=1024, global_batch=1792)


def test_plans_are_legal_fitting_and_sorted():
    plans = _plans_76b()
    assert [e.seconds_per_iteration for e in plans] == sorted(e.seconds_per_iteration for e in plans)
    for e in plans:
        assert e.fits and e.gpus == 1024 and GPT76B.heads % e.tp == 0 and e.tp <= 8 and e.pp <= GPT76B.layers
        assert 1792 % e.dp == 0
    assert (1, 1) not in {(e.tp, e.pp) for e in plans}       # 76B does not fit one GPU
    assert plans[0].tp == 8 and plans[0].pp == 4             # the paper's split


def test_explain_names_what_the_runners_up_lose():
    text = explain(_plans_76b())
    assert text.startswith("1. tp=8 pp=4") and "slower than 1., mostly in" in text and "3. " in text


def test_too_big_a_model_is_refused_with_the_least_memory():
    with pytest.raises(ValueError, match="no split of 4 GPUs fits .* the least memory is .* GiB at tp=4 pp=1"):
        plan(GPT76B, gpus=4, global_batch=8)


def test_shape_is_read_from_hugging_face_and_nanogpt_configs():
    hf = build_model("gpt2", layers=3, hidden=64, heads=4)
    assert shape_of(hf) == ModelShape(hidden=64, layers=3, heads=4, vocab=hf.config.vocab_size,
                                      seq=hf.config.n_positions)
    nano = GPT(GPTConfig(n_layer=2, n_head=4, n_embd=64, vocab_size=128, block_size=32))
    assert shape_of(nano) == ModelShape(64, 2, 4, 128, 32)
    with pytest.raises(ValueError, match="Linear: it has no `config`"):
        shape_of(torch.nn.Linear(2, 2))


@pytest.mark.simulation
def test_autoshard_world_size_compiles_the_planners_choice():
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=4, n_head=4, n_embd=64, vocab_size=128, block_size=32))
    with pytest.warns(UserWarning, match="plan: no seq= given"):     # no example call: the config's block_size
        prog = autoshard(model, world_size=4, global_batch=8)
    best = prog.planned          # of the planner's first three, the fastest by its graphs that fits
    assert best in plan(model, gpus=4, global_batch=8, seq=32)[:3] and prog.planned_seconds > 0
    assert (prog.tp, prog.pp, prog.dp, prog.virtual) == (best.tp, best.pp, best.dp, best.virtual)
    assert prog.world_size == 4 and prog.microbatches == best.microbatches
    assert prog.schedule_name == (best.schedule if best.pp > 1 else "1f1b")
    ids = torch.randint(0, 128, (2, 16))
    assert torch.allclose(prog.simulate(ids)[0], model(ids)[0], atol=1e-5)


def _plan_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if str(w.message).startswith("plan:")]


def test_plan_says_when_it_falls_back_to_the_configs_maximum():
    """Regression: plan(model) without seq= planned for max_position_embeddings and said nothing."""
    hf = build_model("llama", layers=2, hidden=64, heads=4)
    maximum = hf.config.max_position_embeddings
    with pytest.warns(UserWarning, match=f"plan is for {maximum} tokens .*max_position_embeddings.*pass seq="):
        assert plan(hf, gpus=2, global_batch=4)[0].seq == maximum
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert plan(hf, gpus=2, global_batch=4, seq=48)[0].seq == 48
        plan(ModelShape(64, 2, 4, 128, 32), gpus=2, global_batch=4)       # a shape carries its seq
    assert not _plan_warnings(caught)


@pytest.mark.simulation
def test_autoshard_world_size_plans_at_the_example_inputs_length():
    """Regression: autoshard(world_size=...) planned for the config's maximum positions although the
    example call gives the length (autoshard train --plan passes --seq-len tokens as its example)."""
    model = build_model("llama", layers=2, hidden=64, heads=4)
    assert model.config.max_position_embeddings != 48
    ids = torch.randint(0, model.config.vocab_size, (2, 48))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        prog = autoshard(model, world_size=2, global_batch=4, example_kwargs={"input_ids": ids, "labels": ids})
    assert prog.planned.seq == 48 and not _plan_warnings(caught)
    assert prog.planned in plan(model, gpus=2, global_batch=4, seq=48)[:3]


def test_plan_searches_the_distributed_optimizer():
    """distributed_optimizer=None weighs both optimizers where dp > 1: the divided one holds less and
    steps 1/dp of the state, so splits that do not fit with a plain AdamW come in (a 13B GPT on 8
    GPUs), and the fastest plan uses it; the default (False) never does."""
    shape = ModelShape(hidden=5120, layers=40, heads=40, vocab=51200, seq=2048)
    key = lambda e: (e.tp, e.pp, e.dp, e.microbatch, e.virtual, e.recompute, e.schedule)     # noqa: E731
    plain = {key(e): e for e in plan(shape, gpus=8, global_batch=64)}
    divided = {key(e): e for e in plan(shape, gpus=8, global_batch=64, distributed_optimizer=True, zero=1)}
    both = plan(shape, gpus=8, global_batch=64, distributed_optimizer=None)
    assert not any(e.distributed_optimizer for e in plain.values())
    assert {e.distributed_optimizer for e in both} == {False, True} and {e.zero for e in both} == {1, 3}
    assert set(divided) - set(plain) and both[0].distributed_optimizer and both[0].dp > 1
    assert ("zero=3" if both[0].zero == 3 else "distributed-optimizer") in both[0].explain()
    k = next(k for k in plain if k in divided and k[2] > 1)
    assert divided[k].memory_gib_per_gpu < plain[k].memory_gib_per_gpu
    assert divided[k].breakdown["optimizer"] == pytest.approx(plain[k].breakdown["optimizer"] / k[2])
    assert all(not e.distributed_optimizer for e in both if e.dp == 1)       # one replica: nothing to divide


def test_an_8b_llama_on_8_gpus_fits_fully_sharded_where_zero1_does_not():
    """Fully sharded data parallelism weighed beside tp/pp: for an 8B Llama (a config on meta) on
    8 x 80 GB at seq 4096 the fastest plan that fits is zero=3, and the same split at zero=1 needs
    more than the GPU holds; the plan says so in its memory breakdown."""
    import transformers as hf
    cfg = hf.LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192)
    with torch.device("meta"):
        model = hf.LlamaForCausalLM(cfg)
    best = plan(model, gpus=8, global_batch=64, seq=4096, distributed_optimizer=None)[0]
    assert best.fits and best.zero == 3 and best.tp * best.pp < 8, best.explain()
    assert "zero=3" in best.explain() and "fsdp_comm" in best.breakdown
    same = dict(hidden=best.hidden, layers=best.layers, heads=best.heads, vocab=best.vocab, seq=best.seq, tp=best.tp,
                pp=best.pp, dp=best.dp, global_batch=64, microbatch=best.microbatch, virtual=best.virtual,
                recompute=best.recompute, schedules=None)
    zero1 = estimate(**same, distributed_optimizer=True)
    assert not zero1.fits and zero1.memory_gib_per_gpu > best.memory_gib_per_gpu + 5, zero1.explain()
    assert estimate(**same, zero=3).memory_gib_per_gpu == pytest.approx(best.memory_gib_per_gpu)


def test_zero_stages_divide_what_they_name():
    """Bytes per parameter: zero=2 divides the gradients too, zero=3 the weights too."""
    from autoshard.planning.memory_model import param_bytes
    assert param_bytes(2, 4, dp=8, zero=2).total == pytest.approx(2 + 4 / 8 + 12 / 8)
    assert param_bytes(2, 4, dp=8, zero=3).total == pytest.approx(18 / 8)
    assert param_bytes(4, 4, dp=4, zero=3).total == pytest.approx(16 / 4)
    with pytest.raises(ValueError, match="zero must be 1, 2 or 3, got 4"):
        estimate(hidden=64, layers=2, heads=4, vocab=128, seq=32, tp=1, pp=1, dp=2, global_batch=4, zero=4)


def test_autoshard_world_size_excludes_an_explicit_split():
    model = GPT(GPTConfig(n_layer=2, n_head=4, n_embd=64, vocab_size=128, block_size=32))
    with pytest.raises(ShardingError, match="world_size=4 asks the planner .* drop tp=2"):
        autoshard(model, world_size=4, tp=2)


def test_autoshard_world_size_without_a_config_says_how_to_plan():
    class Plain(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.lin(x)

    with pytest.raises(ShardingError, match="world_size=2: cannot read the shape of Plain.*autoshard.plan"):
        autoshard(Plain(), world_size=2, example_inputs=(torch.randn(2, 4),))


def test_docstring_examples_run():
    import doctest

    import autoshard.planning.costmodel
    import autoshard.planning.planner
    for module in (autoshard.planning.costmodel, autoshard.planning.planner):
        result = doctest.testmod(module)
        assert result.attempted > 0 and result.failed == 0, module.__name__


@pytest.mark.simulation
def test_world_size_keeps_the_fastest_split_that_fits_when_read_off_its_graphs():
    """Regression: autoshard(world_size=...) compiled the table's first pick unchecked. An fp32 Llama
    planned for a 16-bit GPU preset holds more than the table says: with memory between the two, the
    first pick is compiled, read off its graphs, set aside, and a later split kept (or, if none
    fits, the error lists what each needs)."""
    import dataclasses

    from autoshard.planning.hardware import get_hardware
    from autoshard.planning.graph_fit import fastest_that_fits
    model = build_model("llama", layers=2, hidden=64, heads=4)
    ids = torch.randint(0, model.config.vocab_size, (2, 32))
    example = {"input_ids": ids, "labels": ids}
    roomy = autoshard(model, world_size=2, global_batch=4, example_kwargs=example)
    first, graph = roomy.planned, max(m.peak for m in roomy.planned_memory)
    assert first in plan(model, gpus=2, global_batch=4, seq=32)[:3] and roomy.planned_seconds > 0
    assert graph > first.memory_gib_per_gpu * 2 ** 30          # fp32 weights and activations
    usable = (first.memory_gib_per_gpu * 2 ** 30 + graph) / 2
    tight = dataclasses.replace(get_hardware("a100-80gb"), memory_gib=usable / 0.9 / 2 ** 30)
    try:
        prog = autoshard(model, world_size=2, global_batch=4, example_kwargs=example, hardware=tight)
    except ShardingError as e:
        assert "read off its compiled graphs" in str(e) and f"tp={first.tp} pp={first.pp}" in str(e)
    else:
        assert prog.planned != first and max(m.peak for m in prog.planned_memory) <= usable
    with pytest.raises(ShardingError, match="none of the planner's 1 fastest splits fits"):
        fastest_that_fits([first], tight, lambda e: roomy, 2, tries=1)
