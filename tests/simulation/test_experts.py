"""Mixture-of-experts decoders from transformers configs (random weights): each expert's
projections split over tp like a dense MLP's (passes/sharding/rules_experts.py), through HF's
grouped_mm or batched_mm experts, the router replicated and reported; outputs and gradients equal
the single-device model's."""
import pytest
import torch

from autoshard import autoshard
from autoshard.testing import grad_errors, max_rel
from autoshard.testing.models import VOCAB, build_moe


@pytest.mark.parametrize("impl", ["grouped_mm", "batched_mm"])
@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe", "olmoe"])
def test_experts_split_over_tensor_parallel_ranks(name, tp, impl):
    # before: gate_up_proj and down_proj "kept whole on every rank" (no rule for
    # transformers.grouped_mm_fallback): Mixtral's rank 0 held 0.89 of the parameters at tp=2;
    # HF's batched_mm experts (bmm of the gathered rows W[ids]) likewise, "no sharding rule for
    # aten.index.Tensor", until passes/expert_matmuls.py
    model = build_moe(name)
    model.config._experts_implementation = impl
    ids = torch.randint(0, VOCAB, (2, 16))
    call = {"input_ids": ids, "labels": (ids * 7 + 3) % VOCAB}
    prog = autoshard(model, tp=tp, example_kwargs=call)
    for layer in range(2):
        for proj, dim in (("gate_up_proj", 1), ("down_proj", 2)):
            use = prog.sharding.params[f"model.layers.{layer}.mlp.experts.{proj}"]
            assert use.dim == dim
            full = model.get_parameter(f"model.layers.{layer}.mlp.experts.{proj}").shape
            assert prog.rank(0).get_parameter(f"model.layers.{layer}.mlp.experts.{proj}").shape[dim] == full[dim] // tp
    assert "whole by design (replicated): model.layers.0.mlp.gate (" in str(prog)      # the router, and why
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    mine = sum(p.numel() for n, p in prog.rank(0).named_parameters() if ".experts." in n)
    assert mine * tp == experts
    out, ref = prog.simulate(**call), model(**call)
    assert max_rel(out.logits, ref.logits) <= 1e-5 and max_rel(out.loss, ref.loss) <= 1e-5
    out.loss.backward()
    ref.loss.backward()
    errs = grad_errors(prog.full_grads(), {n: p.grad for n, p in model.named_parameters()})
    assert max(errs.values()) <= 1e-5, errs


def _equals_the_model(prog, model, ids) -> None:
    """Outputs, and gradients of a loss of them, equal the single-device model's."""
    out, ref = prog.simulate(ids), model(ids)
    assert max_rel(out, ref) <= 1e-5
    out.square().mean().backward()
    ref.square().mean().backward()
    errs = grad_errors(prog.full_grads(), {n: p.grad for n, p in model.named_parameters()})
    assert max(errs.values()) <= 1e-5, errs


class _Expert(torch.nn.Module):
    def __init__(self, d: int, h: int):
        super().__init__()
        self.w1, self.w3 = torch.nn.Linear(d, h, bias=False), torch.nn.Linear(d, h, bias=False)
        self.w2 = torch.nn.Linear(h, d, bias=False)

    def forward(self, x):
        return self.w2(torch.nn.functional.silu(self.w1(x)) * self.w3(x))


class _LoopMoE(torch.nn.Module):
    """Experts as a loop over modules with data-dependent token selection (torch.where(cond))."""

    def __init__(self, d: int = 32, h: int = 64, experts: int = 4, k: int = 2):
        super().__init__()
        self.k, self.norm, self.gate = k, torch.nn.LayerNorm(d), torch.nn.Linear(d, experts, bias=False)
        self.experts = torch.nn.ModuleList(_Expert(d, h) for _ in range(experts))

    def forward(self, x):
        b, t, d = x.shape
        flat = self.norm(x).reshape(-1, d)                                   # [b * t, d]
        weights, chosen = torch.softmax(self.gate(flat), dim=-1).topk(self.k, dim=-1)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            rows, slot = torch.where(chosen == e)
            out = out.index_add(0, rows, expert(flat[rows]) * weights[rows, slot, None])
        return x + out.reshape(b, t, d)


class _LoopMoEModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.head = torch.nn.Embedding(64, 32), torch.nn.Linear(32, 64)
        self.blocks = torch.nn.ModuleList(_LoopMoE() for _ in range(2))

    def forward(self, ids):
        x = self.emb(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


@pytest.mark.parametrize("tp", [2, 4])
def test_experts_written_as_a_loop_over_linear_modules(tp):
    # before: AttributeError: 'list' object has no attribute 'shape' inside the analysis (the
    # elementwise rule took the one-argument torch.where, which returns index tensors, for an
    # elementwise op)
    torch.manual_seed(0)
    model = _LoopMoEModel()
    ids = torch.randint(0, 64, (2, 8))
    prog = autoshard(model, tp=tp, example_inputs=(ids,))
    assert prog.sharding.params["blocks.0.experts.3.w1.weight"].dim == 0
    assert prog.sharding.params["blocks.0.experts.3.w2.weight"].dim == 1
    assert "blocks.0.gate.weight" not in prog.sharding.params               # the router: replicated
    _equals_the_model(prog, model, ids)


class _EinsumExperts(torch.nn.Module):
    """Experts as stacked 3-D weights applied to every token with einsum, mixed by the router's
    probabilities; `w_in` stored [experts, out, in] (read transposed), `w_out` [experts, in, out]."""

    def __init__(self, d: int = 32, h: int = 64, e: int = 4):
        super().__init__()
        self.emb, self.head = torch.nn.Embedding(64, d), torch.nn.Linear(d, 64)
        self.gate = torch.nn.Linear(d, e, bias=False)
        self.w_in = torch.nn.Parameter(torch.randn(e, h, d) / d ** 0.5)
        self.w_out = torch.nn.Parameter(torch.randn(e, h, d) / h ** 0.5)

    def forward(self, ids):
        x = self.emb(ids)                                                   # [b, t, d]
        probs = torch.softmax(self.gate(x), -1)                              # [b, t, e]
        hid = torch.relu(torch.einsum("btd,ehd->bteh", x, self.w_in))        # [b, t, e, h]
        y = torch.einsum("bteh,ehd->bted", hid, self.w_out)                  # [b, t, e, d]
        return self.head(x + torch.einsum("bted,bte->btd", y, probs))


@pytest.mark.parametrize("tp", [2, 4])
def test_experts_written_with_einsum_split_like_linear_layers(tp):
    # before: w_in and w_out replicated (no rule for aten.einsum with a parameter operand)
    torch.manual_seed(0)
    model = _EinsumExperts()
    ids = torch.randint(0, 64, (2, 8))
    prog = autoshard(model, tp=tp, example_inputs=(ids,))
    assert prog.sharding.params["w_in"].dim == 1 and prog.sharding.params["w_out"].dim == 1
    assert prog.rank(0).get_parameter("w_in").shape == (4, 64 // tp, 32)
    code = prog.rank(0).code
    assert code.count("einsum_linear(") == 2 and "einsum.default(" in code      # the mixing einsum stays
    _equals_the_model(prog, model, ids)
