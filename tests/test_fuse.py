"""The fusion pass: rank graphs with fused ops compute what the unfused ones compute (on the CPU
the fused ops are their exact torch implementations), and the rewrites are a table."""
import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from autoshard.passes import fuse as fuse_pass
from torch import nn

from autoshard import autoshard
from autoshard.testing import build_model, grad_errors, max_rel
from autoshard.testing.models import VOCAB, input_name, logits_of

# what each model's rank graph should get: LayerNorms, the MLP's bias+GeLU, SiLU*up, bias+residual
EXPECTED = {"nanogpt": {"layer_norm", "bias_gelu", "bias_residual"}, "gpt2": {"layer_norm"},
            "llama": {"swiglu"}}


def _fused(prog, rank=0) -> set[str]:
    return {n.meta["fused"] for n in prog.rank(rank).graph_module.graph.nodes if "fused" in n.meta}


@pytest.mark.parametrize("name", list(EXPECTED))
def test_fused_rank_graphs_match_unfused_forward_and_gradients(name):
    torch.manual_seed(0)
    model = build_model(name, heads=8, kv_heads=2)
    ids, labels = torch.randint(0, VOCAB, (2, 16)), torch.randint(0, VOCAB, (2, 16))
    kw = {input_name(name): ids}
    results = []
    for fuse in (False, True):
        prog = autoshard(model, tp=2, example_kwargs=kw, fuse=fuse)
        out = prog.simulate(**kw)
        F.cross_entropy(logits_of(out).reshape(-1, VOCAB), labels.reshape(-1)).backward()
        results.append((logits_of(out).detach(), prog.full_grads(), _fused(prog)))
    (plain, plain_grads, none), (fused, fused_grads, kinds) = results
    assert none == set() and kinds == EXPECTED[name]
    assert max_rel(fused, plain) <= 1e-5
    errs = grad_errors(fused_grads, plain_grads)
    worst = max(errs, key=errs.get)
    assert errs[worst] <= 1e-5, f"{worst}: {errs[worst]:.2e}"


def test_fused_ops_land_in_their_layers_pipeline_stage():
    model = build_model("nanogpt", layers=4)
    ids = torch.randint(0, VOCAB, (2, 16))
    prog = autoshard(model, tp=2, pp=2, microbatches=2, example_inputs=(ids,), fuse=True)
    stages = prog.stage_modules(0)
    per_stage = [sum(n.op == "call_function" and "autoshard" in str(n.target) for n in s.graph.nodes)
                 for s in stages]
    total = sum(n.op == "call_function" and "autoshard" in str(n.target)
                for n in prog.rank(0).graph_module.graph.nodes)
    assert sum(per_stage) == total and all(per_stage)      # none lost, none duplicated, both stages fused


def test_cpu_models_are_not_fused_by_default():
    model = build_model("nanogpt")
    assert _fused(autoshard(model, tp=2, example_inputs=(torch.randint(0, VOCAB, (2, 8)),))) == set()


class _Broadcasting(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Linear(8, 8)

    def forward(self, x):
        gate = self.w(x)
        return F.silu(gate) * x[..., :1]           # up broadcasts over the features: still SiLU * up


def test_a_broadcasting_match_stays_exact():
    model = _Broadcasting()
    x = torch.randn(3, 8, requires_grad=True)
    prog = autoshard(model, tp=1, example_inputs=(x,), fuse=True)
    assert _fused(prog) == {"swiglu"}
    got, want = prog.simulate(x), model(x)
    assert max_rel(got, want) <= 1e-6
    (g1,) = torch.autograd.grad(got.square().sum(), x)
    (g2,) = torch.autograd.grad(want.square().sum(), x)
    assert max_rel(g1, g2) <= 1e-6


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
