"""Pipeline partitioning: stage graphs (tier a), all stages in one process against the model (tier b),
the executor on a one-process gloo group, and the errors for bad input."""

import re

import pytest
import torch
from torch import nn

from autoshard import autoshard
from autoshard.errors import ShardingError
from autoshard.passes.graph_reading import module_path
from autoshard.passes.stages import layers_per_stage
from autoshard.runtime.batching import pick_loss, split_batch
from autoshard.testing.graphs import fused_ops
from autoshard.testing.metrics import grad_errors, max_rel
from autoshard.testing.models import build_model, input_name, label_name


def _kwargs(name, ids):
    # labels other than the inputs: with a tied head, predicting the input token is nearly free
    # and the loss (~1e-5) would measure nothing
    return {input_name(name): ids, label_name(name): (ids * 7 + 3) % 128}


def _loss(out):
    return out[1] if isinstance(out, tuple) else out.loss


@pytest.mark.parametrize("name", ["nanogpt", "gpt2", "llama"])
@pytest.mark.parametrize("tp,pp,v,fuse", [(1, 2, 1, False), (1, 4, 2, False), (2, 2, 2, False), (2, 4, 1, False),
                                          (2, 2, 2, True)])
def test_stages_in_one_process_match_the_model(name, tp, pp, v, fuse):
    """fuse: the fused ops (their torch implementations here) inside interleaved stages."""
    model = build_model(name, layers=8)
    kw = _kwargs(name, torch.randint(0, 128, (2, 16)))
    prog = autoshard(model, tp=tp, pp=pp, virtual=v, microbatches=pp, example_kwargs=kw, fuse=fuse)
    assert bool(fused_ops(prog.rank(0).graph_module)) == fuse
    out, ref = prog.simulate(**kw), model(**kw)
    assert max_rel(_loss(out), _loss(ref)) < 1e-5
    _loss(out).backward()
    _loss(ref).backward()
    errs = grad_errors(prog.full_grads(), {n: p.grad for n, p in model.named_parameters()})
    assert max(errs.values()) < 1e-5, max(errs.items(), key=lambda kv: kv[1])


def test_llama_rope_tables_are_recomputed_not_sent():
    """Rotary cos/sin and the causal mask come from the inputs alone: every stage recomputes them,
    and only the hidden states cross a stage boundary (torch.distributed.pipelining's tracer fails
    on this model)."""
    model = build_model("llama", layers=4)
    prog = autoshard(model, pp=4, microbatches=4, example_kwargs=_kwargs("llama", torch.randint(0, 128, (2, 16))))
    stages = prog.stage_graphs(prog.rank(0).graph_module)
    assert [len(sg.receives) for sg in stages] == [0, 1, 1, 1]
    for sg in stages[1:]:
        inv_freq = [n for n in sg.graph.nodes if n.op == "get_attr" and "inv_freq" in str(n.target)]
        assert inv_freq, f"stage {sg.index} does not compute its rotary tables"


def test_each_stage_holds_its_layers_and_the_ends():
    model = build_model("gpt2", layers=6)
    prog = autoshard(model, pp=2, virtual=2, microbatches=2,
                     example_kwargs=_kwargs("gpt2", torch.randint(0, 128, (2, 16))))
    stages = prog.stage_graphs(prog.rank(0).graph_module)
    assert [sg.layers for sg in stages] == [range(0, 1), range(1, 3), range(3, 5), range(5, 6)]
    for sg in stages:
        paths = {module_path(n) for n in sg.graph.nodes if n.op == "call_function"}
        layers = {int(p.split(" ")[0].split(".")[2]) for p in paths if p.startswith("transformer.h.")}
        assert layers == set(sg.layers), (sg.index, layers)
    reads = [{n.target for n in sg.graph.nodes if n.op == "get_attr"} for sg in stages]
    assert "transformer.wte.weight" in reads[0] and "transformer.wte.weight" in reads[-1]   # tied
    assert "transformer.ln_f.weight" in reads[-1] and "transformer.ln_f.weight" not in reads[0]
    assert prog.shared_params == {(0, 1): ["transformer.wte.weight"]}
    assert "def forward(self, input_ids, labels, use_cache, add_" in prog.stage_modules(0)[1].code
    assert "stage 3 (pipeline rank 1, chunk 1): layers 5-5" in str(prog)


@pytest.mark.parametrize("layers,stages,want", [(8, 4, [2, 2, 2, 2]), (10, 4, [2, 3, 3, 2]), (9, 4, [2, 3, 2, 2]),
                                                (11, 4, [3, 3, 3, 2]), (5, 2, [3, 2]), (4, 4, [1, 1, 1, 1])])
def test_uneven_layer_counts_go_to_middle_stages_first(layers, stages, want):
    assert layers_per_stage(layers, stages) == want


def test_split_batch_and_errors():
    parts = split_batch({"ids": torch.arange(12).view(6, 2), "flag": False}, 3, "microbatches")
    assert [p["ids"][:, 0].tolist() for p in parts] == [[0, 2], [4, 6], [8, 10]]
    assert all(p["flag"] is False for p in parts)
    with pytest.raises(ShardingError, match="a batch of 6 samples cannot be split into microbatches = 4 equal"):
        split_batch({"ids": torch.zeros(6, 2)}, 4, "microbatches")
    with pytest.raises(ShardingError, match="2 scalar tensors"):
        pick_loss((torch.tensor(1.0), torch.tensor(2.0)))


def test_bad_pipeline_configurations():
    model = build_model("gpt2", layers=4)
    kw = _kwargs("gpt2", torch.randint(0, 128, (2, 16)))
    with pytest.raises(ShardingError, match="8 pipeline stages .* need at least 8 layers, the model has 4"):
        autoshard(model, pp=4, virtual=2, microbatches=4, example_kwargs=kw)
    with pytest.raises(ShardingError, match="5 pipeline stages .* the model has 4"):
        autoshard(model, pp=5, microbatches=5, example_kwargs=kw)
    with pytest.raises(ShardingError, match="microbatches divisible by pp: 6 microbatches, pp=4"):
        autoshard(model, pp=4, virtual=2, microbatches=6, example_kwargs=kw)
    with pytest.raises(ShardingError, match="virtual=2 chunks per rank need pp > 1"):
        autoshard(model, virtual=2, example_kwargs=kw)
    with pytest.raises(ShardingError, match="dp must be a positive integer, got 0"):
        autoshard(model, dp=0, example_kwargs=kw)
    flat = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    with pytest.raises(ShardingError, match="found no repeated layers"):
        autoshard(flat, pp=2, example_inputs=(torch.randn(4, 8),))


def test_executor_accumulates_microbatches(one_process_group):
    """The executor on a real (one-rank) process group: 4 microbatches and gradient clipping give
    single-device results on the whole batch; a program for 2 ranks refuses this group."""
    model, ref = build_model("llama", layers=2), build_model("llama", layers=2)
    ids = torch.randint(0, 128, (8, 16))
    prog = autoshard(model, microbatches=4, example_kwargs=_kwargs("llama", ids[:2]))
    rt = prog.distributed()
    loss = rt.train_step(**_kwargs("llama", ids), max_norm=0.5)
    ref_loss = ref(**_kwargs("llama", ids)).loss
    ref_loss.backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
    assert max_rel(loss, ref_loss) < 1e-6
    assert max_rel(rt.last_grad_norm.float(), ref_norm) < 1e-6
    errs = grad_errors({n: p.grad for n, p in rt.named_parameters()}, {n: p.grad for n, p in ref.named_parameters()})
    assert max(errs.values()) < 1e-5
    assert [str(r.action) for r in rt.records if r.action.kind in "FB"] == ["F0", "B0", "F1", "B1", "F2", "B2",
                                                                          "F3", "B3"]
    with pytest.raises(ShardingError, match="a batch of 6 samples cannot be split into microbatches = 4"):
        rt.train_step(**_kwargs("llama", ids[:6]))
    two = autoshard(build_model("llama", layers=2), pp=2, microbatches=2, example_kwargs=_kwargs("llama", ids[:2]))
    with pytest.raises(ShardingError, match="the process group has 1 ranks but .* tp=1 x pp=2 x dp=1 = 2"):
        two.distributed()


@pytest.mark.parametrize("name,sp", [("bert", False), ("gpt2", True), ("llama", True), ("nanogpt", False)])
def test_only_hidden_states_cross_stages_under_tensor_parallelism(name, sp):
    """At tp=2 an f (identity forward) sits between the last norm of one stage and the first matmul
    of the next: it runs in the later stage, so the hidden states are sent once, not twice."""
    model = build_model(name, layers=4)
    kw = _kwargs(name, torch.randint(0, 128, (2, 16)))
    prog = autoshard(model, tp=2, pp=2, microbatches=2, example_kwargs=kw, sequence_parallel=sp)
    assert [len(sg.receives) for sg in prog.stage_graphs(prog.rank(0).graph_module)] == [0, 1]
    assert max_rel(_loss(prog.simulate(**kw)), _loss(model(**kw))) < 1e-5


def test_executor_with_a_loss_outside_the_model(one_process_group):
    """nanoGPT called without targets returns logits; the loss comes from loss_fn on the last stage,
    with the targets cut into the same microbatches."""
    import torch.nn.functional as F
    model, ref = build_model("nanogpt", layers=2), build_model("nanogpt", layers=2)
    ids, labels = torch.randint(0, 128, (8, 16)), torch.randint(0, 128, (8, 16))
    prog = autoshard(model, microbatches=4, example_inputs=(ids[:2],))
    rt = prog.distributed()

    def loss_fn(out, y):
        return F.cross_entropy(out[0].reshape(-1, 128), y.reshape(-1))

    loss = rt.train_step(ids, loss_fn=loss_fn, targets=labels)
    ref_loss = loss_fn(ref(ids), labels)
    ref_loss.backward()
    assert max_rel(loss, ref_loss) < 1e-6
    errs = grad_errors({n: p.grad for n, p in rt.named_parameters()}, {n: p.grad for n, p in ref.named_parameters()})
    assert max(errs.values()) < 1e-5


def test_balanced_cuts_follow_the_costs():
    """A head as costly as four layers moves layers off the last stage; a cheap one leaves the even
    counts; stage_cuts are read as each later stage's first layer and refused naming the problem."""
    from autoshard.passes.stage_balance import LayerCosts, balanced_counts
    from autoshard.passes.stages import counts_from_cuts
    heavy_head = LayerCosts(layers=(1.0,) * 8, before=0.1, after=4.0)
    assert balanced_counts(heavy_head, 2) == [6, 2] and heavy_head.stage_seconds([6, 2]) == [6.1, 6.0]
    assert balanced_counts(LayerCosts((1.0,) * 8, 0.1, 0.2), 2) == [4, 4]
    uneven = LayerCosts(layers=(2.0,) * 4 + (1.0,) * 4, before=0.0, after=0.0)   # a planted imbalance
    assert balanced_counts(uneven, 2) == [3, 5]
    assert counts_from_cuts([3, 6], 8, 3) == [3, 3, 2]
    for cuts in ([3], [6, 3], [0, 4], [3, 8]):
        with pytest.raises(ShardingError, match=r"stage_cuts=\["):
            counts_from_cuts(cuts, 8, 3)


def _llama(*, vocab: int, layers: int, rows: int) -> tuple[nn.Module, dict]:
    """A small HF Llama (hidden 64) and a batch of `rows` x 16 ids with labels."""
    import transformers as hf
    cfg = hf.LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = hf.LlamaForCausalLM(cfg)
    g = torch.Generator().manual_seed(1)
    return model, dict(input_ids=torch.randint(0, vocab, (rows, 16), generator=g),
                       labels=torch.randint(0, vocab, (rows, 16), generator=g))


def test_a_heavy_head_is_balanced_and_a_hand_cut_is_kept():
    """Llama, 8 layers, a 4096-word vocabulary: the head and loss cost about six layers, so layer
    counts [4, 4] leave the first pipeline rank idle; the balanced cut gives the first stage more
    layers. Exact against one device either way; print(prog) shows each stage's predicted time."""
    model, kw = _llama(vocab=4096, layers=8, rows=2)
    ref = model(**kw)
    ref.loss.backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    worst = {}
    for cuts in ([4], None):
        prog = autoshard(model, pp=2, microbatches=2, example_kwargs=kw, stage_cuts=cuts)
        counts = prog.stage_counts
        assert counts == [4, 4] if cuts else counts[0] > 4, counts
        worst[bool(cuts)] = max(prog.predicted_stage_seconds)
        assert re.search(r"stage 1 \(pipeline rank 1, chunk 0\): layers \d-7, predicted forward [\d.e-]+ ms", str(prog))
        out = prog.simulate(**kw)
        assert max_rel(out.loss, ref.loss) <= 1e-5
        out.loss.backward()
        errs = grad_errors(prog.full_grads(), ref_grads)
        assert max(errs.values()) <= 1e-5, max(errs.items(), key=lambda kv: kv[1])
    assert worst[False] < 0.8 * worst[True], worst          # the balanced cut's slowest stage is faster


def test_schedule_auto_is_chosen_from_the_graph_and_says_why():
    """schedule="auto" prices the captured graph's F, B and W (passes/stage_balance.phase_costs),
    runs the candidates in the event simulator and keeps the fastest: exact against one device,
    its reasons in print(prog). A hardware whose split backward costs twice one backward gets no
    zero-bubble schedule; hand cuts, or a virtual given, allow only the candidates with that many
    stages or chunks a rank."""
    from autoshard.planning.hardware import get_hardware
    from autoshard.runtime.schedules import schedule_spec
    model, kw = _llama(vocab=512, layers=4, rows=4)
    example = {k: v[:1] for k, v in kw.items()}
    ref = model(**kw)
    prog = autoshard(model, pp=2, microbatches=4, schedule="auto", example_kwargs=example)
    choice = prog.schedule_choice
    assert prog.schedule_name == choice.name == choice.order()[0] and len(choice.order()) == 5
    assert f'chosen by schedule="auto": schedule {choice.name}' in str(prog)
    assert max_rel(prog.simulate(**kw).loss, ref.loss) <= 1e-5
    dear = autoshard(model, pp=2, microbatches=4, schedule="auto", example_kwargs=example,
                     hardware=get_hardware("a100-80gb", split_backward=2.0))
    assert not schedule_spec(dear.schedule_name).split, dear.schedule_choice.explain()
    cut = autoshard(model, pp=2, microbatches=4, schedule="auto", example_kwargs=example, stage_cuts=[2])
    assert cut.virtual == 1 and cut.schedule_choice.order() and set(cut.schedule_choice.order()) == {"1f1b", "zb-h1"}
    two = autoshard(model, pp=2, virtual=2, microbatches=4, schedule="auto", example_kwargs=example)
    assert two.virtual == 2 and set(two.schedule_choice.order()) == {"interleaved", "zbv", "v-half"}
    with pytest.raises(ShardingError, match=r'schedule="auto" with stage_cuts=\[1, 2\]'):
        autoshard(model, pp=2, microbatches=4, schedule="auto", example_kwargs=example, stage_cuts=[1, 2])


def test_phase_costs_price_the_backward_halves():
    """A matmul reading a weight costs its FLOPs once in B and once in W; a matmul of two
    activations (attention's) twice in B; F + B + W stays three forwards for matmuls."""
    from autoshard.passes.stage_balance import Rates, phase_costs

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Linear(32, 32, bias=False)

        def forward(self, x):
            h = self.w(x)
            return h @ h.transpose(-1, -2) @ h          # two matmuls of activations

    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([Block(), Block()])

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x
    gm = torch.export.export(Two(), (torch.randn(4, 8, 32),)).module()
    f, b, w = phase_costs(gm.graph, Rates(flops=1.0, bytes=1e30))
    lin, scores = 2 * 4 * 8 * 32 * 32, 2 * 2 * 4 * 8 * 8 * 32
    assert f.layers == pytest.approx((lin + scores,) * 2, rel=1e-6)
    assert b.layers == pytest.approx((lin + 2 * scores,) * 2, rel=1e-6) and w.layers == pytest.approx((lin,) * 2, rel=1e-6)
