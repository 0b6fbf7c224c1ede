"""The fusion pass: rank graphs with fused ops compute what the unfused ones compute (on the CPU
the fused ops are their exact torch implementations), and the rewrites are a table."""
import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from autoshard import autoshard
from autoshard.kernels import cpu_executor
from autoshard.passes.fusion import fuse as fuse_pass
from autoshard.testing import build_model, fused_ops, grad_errors, max_rel
from autoshard.testing.models import VOCAB, input_name, logits_of

# what each model's rank graph should get: LayerNorms, the MLP's bias+GeLU (GPT-2: its written-out tanh
# GeLU), SiLU*up, bias+residual, and nanoGPT's written-out attention its causal softmax
EXPECTED = {"nanogpt": {"layer_norm", "bias_gelu", "bias_residual"},
            "nanogpt-manual": {"layer_norm", "bias_gelu", "bias_residual", "causal_softmax"},
            "gpt2": {"layer_norm", "gelu_tanh", "bias_residual"}, "llama": {"rms_norm", "rotary", "swiglu"}}


def _fused(prog, rank=0) -> set[str]:
    return set(fused_ops(prog.rank(rank).graph_module))


def _dead(prog, rank=0) -> list[str]:
    """Ops whose results nothing reads (a fusion that left part of its match behind)."""
    return [n.name for n in prog.rank(rank).graph_module.graph.nodes
            if n.op == "call_function" and not n.users and n.target != torch.ops.aten._assert_tensor_metadata.default]


def _assert_matches_model(prog, model: nn.Module, x: torch.Tensor) -> None:
    """The one-rank program's output and its gradient wrt x equal the model's (<= 1e-6)."""
    got, want = prog.simulate(x), model(x)
    assert max_rel(got, want) <= 1e-6
    (g1,) = torch.autograd.grad(got.square().sum(), x)
    (g2,) = torch.autograd.grad(want.square().sum(), x)
    assert max_rel(g1, g2) <= 1e-6


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _fused_matches_unfused(name: str, device: str, sp: bool) -> int:
    """fp32, tp=2: the fused rank program's logits and every gradient against the unfused one's
    (<= 1e-5); returns how many kernel launches it took."""
    from autoshard.kernels.launch import LAUNCHES
    torch.manual_seed(0)
    model = build_model(name, heads=8, kv_heads=2).to(device)
    ids, labels = torch.randint(0, VOCAB, (2, 16), device=device), torch.randint(0, VOCAB, (2, 16), device=device)
    kw = {input_name(name): ids}
    results = []
    launches = sum(LAUNCHES.values())
    for fuse in (False, True):
        prog = autoshard(model, tp=2, example_kwargs=kw, fuse=fuse, sequence_parallel=sp)
        out = prog.simulate(**kw)
        F.cross_entropy(logits_of(out).reshape(-1, VOCAB), labels.reshape(-1)).backward()
        results.append((logits_of(out).detach(), prog.full_grads(), _fused(prog)))
        assert _dead(prog) == []
    (plain, plain_grads, none), (fused, fused_grads, kinds) = results
    assert none == set() and kinds == EXPECTED[name]
    assert max_rel(fused, plain) <= 1e-5
    errs = grad_errors(fused_grads, plain_grads)
    worst = max(errs, key=errs.get)
    assert errs[worst] <= 1e-5, f"{worst}: {errs[worst]:.2e}"
    return sum(LAUNCHES.values()) - launches


@pytest.mark.parametrize("device,sp", [("cpu", False), ("cpu", True), pytest.param("cuda", False, marks=CUDA)])
@pytest.mark.parametrize("name", list(EXPECTED))
def test_fused_rank_graphs_match_unfused_forward_and_gradients(name, device, sp):
    """On the CPU the fused ops' torch implementations, on CUDA their kernels (which must have run)
    against the unfused graph's torch ops; also under sequence parallelism, where biases and norm
    weights are read through f."""
    assert (_fused_matches_unfused(name, device, sp) > 0) == (device == "cuda")


@pytest.mark.skipif(cpu_executor.compiler() is None, reason="no host C++ compiler (g++ or $CXX) for the CPU executor")
@pytest.mark.parametrize("name", list(EXPECTED))
def test_fused_rank_programs_on_the_emulated_cuda_kernels_match_unfused(name):
    """The CUDA kernels themselves, run by the CPU executor through launch.py's path (pack choice,
    strides, grid sizing): every fused op of the model launched its kernels, forward and backward,
    and the program equals the unfused one."""
    from autoshard.kernels.cpu_executor import GRIDS
    GRIDS.clear()
    with cpu_executor.enabled(schedule="run-ahead"):
        assert _fused_matches_unfused(name, "cpu", sp=False) > 0
    kernels = {k for k, _, _ in GRIDS}
    wanted = {"layer_norm": {"norm_fwd", "norm_bwd"}, "rms_norm": {"norm_fwd", "norm_bwd"}, "rotary": {"rope_apply"},
              "swiglu": {"swiglu_fwd", "swiglu_bwd"}, "bias_gelu": {"bias_gelu_fwd", "bias_gelu_bwd"},
              "gelu_tanh": {"bias_gelu_fwd", "bias_gelu_bwd"}, "bias_residual": {"bias_dropout_add_fwd"},
              "causal_softmax": {"scaled_masked_softmax_fwd", "scaled_masked_softmax_bwd"}}
    assert set().union(*(wanted[k] for k in EXPECTED[name])) <= kernels, kernels


def test_a_fused_rotary_keeps_the_layout_the_model_views_its_attention_in():
    """Regression: JetMoE with fuse=True failed on a `view`: its q [b, heads, s, d] is a transpose of
    [b, s, heads, d], SDPA's output takes q's layout, and the model views that output transposed;
    the fused rotary returned a contiguous q, so the view no longer fit."""
    from autoshard.testing.current_models import build_current
    model = build_current("JetMoe")
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    prog = autoshard(model, tp=2, fuse=True, example_kwargs={"input_ids": ids, "labels": ids})
    assert "rotary" in _fused(prog)
    got, want = prog.simulate(input_ids=ids, labels=ids), model(input_ids=ids, labels=ids)
    assert max_rel(got.logits, want.logits) <= 1e-5
    got.loss.backward()
    want.loss.backward()
    errs = grad_errors(prog.full_grads(), {n: p.grad for n, p in model.named_parameters()})
    assert max(errs.values()) <= 1e-4, max(errs.items(), key=lambda kv: kv[1])


def test_fused_ops_land_in_their_layers_pipeline_stage():
    model = build_model("nanogpt", layers=4)
    ids = torch.randint(0, VOCAB, (2, 16))
    prog = autoshard(model, tp=2, pp=2, microbatches=2, example_inputs=(ids,), fuse=True)
    stages = prog.stage_modules(0)
    per_stage = [len(fused_ops(s)) for s in stages]
    total = len(fused_ops(prog.rank(0).graph_module))
    assert sum(per_stage) == total and all(per_stage)      # none lost, none duplicated, both stages fused


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
def test_models_are_not_fused_by_default_on_any_device(device):
    """Fusion is opt-in on GPUs too: on the first GPU run (H200, 2026-11-27) a fused 406M Llama's
    step took 1.50x as long (the launches cost the host more than the kernels save)."""
    model = build_model("nanogpt").to(device)
    example = (torch.randint(0, VOCAB, (2, 8), device=device),)
    assert _fused(autoshard(model, tp=2, example_inputs=example)) == set()
    assert _fused(autoshard(model, tp=2, example_inputs=example, fuse=True)) == EXPECTED["nanogpt"]


class _Broadcasting(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Linear(8, 8)

    def forward(self, x):
        gate = self.w(x)
        return F.silu(gate) * x[..., :1]           # up broadcasts over the features: still SiLU * up


def test_a_broadcasting_operand_is_not_fused_and_stays_exact():
    """SiLU(gate) * up with up [3, 1]: swiglu's kernel reads up as the full [3, 8] (before, this
    fused, and the kernel read past up's 3 elements on a GPU)."""
    model = _Broadcasting()
    x = torch.randn(3, 8, requires_grad=True)
    prog = autoshard(model, tp=1, example_inputs=(x,), fuse=True)
    assert _fused(prog) == set()
    _assert_matches_model(prog, model, x)


class _MaskedAttention(nn.Module):
    """softmax((x @ x^T) * 0.5, masked where mask[:, :, :n, :n] == 0) @ x over [b, h, t, d]; n is
    the scores' length t unless `length` fixes it."""
    def __init__(self, mask: torch.Tensor, length: int | None = None):
        super().__init__()
        self.register_buffer("mask", mask)
        self.length = length

    def forward(self, x):
        n = x.size(2) if self.length is None else self.length
        att = (x @ x.transpose(-2, -1)) * 0.5                                   # (b, h, t, t)
        att = att.masked_fill(self.mask[:, :, :n, :n] == 0, float("-inf"))
        return F.softmax(att, dim=-1) @ x


_CAUSAL = torch.ones(12, 12).tril().view(1, 1, 12, 12)


@pytest.mark.parametrize("mask,length,fused", [
    (_CAUSAL, None, {"causal_softmax"}),
    (_CAUSAL - torch.ones(12, 12).tril(-3).view(1, 1, 12, 12), None, set()),   # a band (sliding window): not causal
    (_CAUSAL.transpose(-2, -1).contiguous(), None, set()),                    # upper triangle: anti-causal
    (_CAUSAL, 1, set()),             # buf[:, :, :1, :1] broadcasts: no mask at all, not the causal one
])
def test_the_causal_softmax_fuses_only_a_provably_causal_mask(mask, length, fused):
    model = _MaskedAttention(mask, length)
    x = torch.randn(2, 3, 8, 4, requires_grad=True)
    prog = autoshard(model, tp=1, example_inputs=(x,), fuse=True)
    assert _fused(prog) == fused
    _assert_matches_model(prog, model, x)


class _WrittenRMSNorm(nn.Module):
    """RMSNorm of x.float() written out as Hugging Face writes it, cast back to x's dtype (`back`)
    or left fp32 (not what the fused norm returns for a bf16 x): Gemma's
    (normed * (1 + w.float())).type_as(x), Olmo2's (w * normed).to(x.dtype)."""
    def __init__(self, form: str, back: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8) * 0.1)
        self.form, self.back = form, back

    def forward(self, x):
        h = x.float()
        normed = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        if self.form == "gemma":
            return (normed * (1.0 + self.weight.float())).type_as(x if self.back else h)
        return (self.weight * normed).to(x.dtype if self.back else torch.float32)


@pytest.mark.parametrize("form", ["gemma", "olmo2"])
@pytest.mark.parametrize("dtype,back,fused", [(torch.float32, True, True), (torch.float32, False, True),
                                              (torch.bfloat16, True, True), (torch.bfloat16, False, False)])
def test_written_out_rms_norms_fuse_where_they_return_their_inputs_dtype(form, dtype, back, fused):
    torch.manual_seed(0)
    model = _WrittenRMSNorm(form, back).to(dtype)
    x = torch.randn(3, 5, 8, dtype=dtype, requires_grad=True)
    prog = autoshard(model, tp=1, example_inputs=(x,), fuse=True)
    assert _fused(prog) == ({"rms_norm"} if fused else set())
    got, want = prog.simulate(x), model(x)
    assert got.dtype == want.dtype and max_rel(got.float(), want.float()) <= 1e-6
    grads = [torch.autograd.grad(y.float().square().sum(), (x, w)) for y, w in
             ((got, prog.rank(0).get_parameter("weight")), (want, model.weight))]
    assert all(max_rel(a.float(), b.float()) <= (1e-5 if dtype == torch.float32 else 1e-2) for a, b in zip(*grads))


def test_a_pattern_does_not_match_a_node_with_arguments_it_does_not_name():
    """x[0:4:2] has a step the slice pattern does not name: it is not x[0:4]."""
    from autoshard.passes.fusion.pattern import P, V, match
    aten = torch.ops.aten
    g = fx.Graph()
    x = g.placeholder("x")
    plain = g.call_function(aten.slice.Tensor, (x, 0, 0, 4))
    strided = g.call_function(aten.slice.Tensor, (x, 0, 0, 4, 2))
    pat = P((aten.slice.Tensor,), (V("x"), V("dim"), V("start"), V("end")))
    assert match(pat, plain, {}, [], lambda t: None)
    assert not match(pat, strided, {}, [], lambda t: None)


def test_rules_are_a_table_a_new_row_is_a_new_fusion():
    aten = torch.ops.aten
    g = fx.Graph()
    x = g.placeholder("x")
    y = g.call_function(aten.relu.default, (g.call_function(aten.neg.default, (x,)),))
    g.output(y)
    row = ("neg_relu", fuse_pass.P((aten.relu.default,), (fuse_pass.P((aten.neg.default,), (fuse_pass.V("x"),)),)),
           lambda call, env, root: call(aten.clamp_min.default, (call(aten.neg.default, (env["x"],)), 0.0)))
    assert fuse_pass.fuse(g, lambda t: None, rules=[]) == []
    done = fuse_pass.fuse(g, lambda t: None, rules=[row])
    assert [name for name, _ in done] == ["neg_relu"]
    gm = fx.GraphModule(nn.Module(), g)
    t = torch.randn(10)
    assert torch.equal(gm(t), torch.relu(-t))
    assert [n.target for n in g.nodes if n.op == "call_function"] == [aten.neg.default, aten.clamp_min.default]


def _dtypes_under_autocast(gm: fx.GraphModule, *inputs) -> dict[str, torch.dtype]:
    """Each node's output dtype under bf16 autocast, a fused node's under the name of the node it replaced."""
    seen = {}

    class Recorder(fx.Interpreter):
        def run_node(self, n):
            out = super().run_node(n)
            if isinstance(out, torch.Tensor):
                seen[n.meta.get("replaces", n.name)] = out.dtype
            return out
    with torch.autocast("cpu", dtype=torch.bfloat16):
        Recorder(gm).run(*inputs)
    return seen


@pytest.mark.parametrize("name", ["nanogpt", "nanogpt-manual"])
def test_fused_ops_return_the_dtypes_of_the_nodes_they_replace_under_autocast(name):
    """bf16 autocast (CPU here; the same dispatch on CUDA): a bias taken out of a linear follows
    the linear's dtype, residual adds promote, so every fused node returns the dtype the unfused
    node returned (bf16 GeLU activations and attention probabilities, fp32 residual stream) and
    the logits agree."""
    torch.manual_seed(0)
    model = build_model(name)
    ids = torch.randint(0, VOCAB, (2, 16))
    gms = [autoshard(model, tp=1, example_inputs=(ids,), fuse=f).rank(0).graph_module for f in (False, True)]
    plain, fused = (_dtypes_under_autocast(gm, ids) for gm in gms)
    replaced = [n.meta["replaces"] for n in gms[1].graph.nodes if "replaces" in n.meta]
    assert {plain[r] for r in replaced} == {torch.bfloat16, torch.float32}      # both kinds were fused
    assert {r: fused[r] for r in replaced} == {r: plain[r] for r in replaced}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        outs = [logits_of(gm(ids)) for gm in gms]
    assert outs[0].dtype == outs[1].dtype and max_rel(outs[1].float(), outs[0].float()) <= 2e-2


@pytest.mark.parametrize("name,backend", [("gpt2", "aot_eager"), ("llama", "aot_eager"), ("nanogpt-manual", "inductor")])
def test_torch_compile_traces_fused_rank_programs_whole(name, backend):
    """torch.compile sees the fused ops as ordinary ops: a fused rank program compiles as one graph
    (fullgraph: no break at a custom op) that keeps every fused op, and the compiled program's
    outputs and gradients equal the eager program's. aot_eager traces autograd through the ops'
    fake implementations; inductor also generates code around them."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = build_model(name, heads=8, kv_heads=2)
    kw = {input_name(name): torch.randint(0, VOCAB, (2, 16))}
    rank = autoshard(model, tp=1, example_kwargs=kw, fuse=True).rank(0)
    seen = []

    def recording(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return torch._dynamo.lookup_backend(backend)(gm, example_inputs)
    compiled = torch.compile(rank, backend=recording, fullgraph=True)
    results = []
    for run in (rank, compiled):
        rank.zero_grad(set_to_none=True)
        out = logits_of(run(**kw))
        out.square().mean().backward()
        results.append((out.detach(), {n: p.grad.clone() for n, p in rank.named_parameters()}))
    fused = fused_ops(rank.graph_module)
    assert len(fused) > 0 and sum(t.startswith("autoshard.") for t in seen) == len(fused)
    (eager, eager_grads), (comp, comp_grads) = results
    assert max_rel(comp, eager) <= 1e-5
    errs = grad_errors(comp_grads, eager_grads)
    assert max(errs.values()) <= 1e-5, max(errs, key=errs.get)
