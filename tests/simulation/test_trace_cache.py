"""The opt-in trace cache (autoshard/compile/trace_cache.py; the suite runs with it on, tests/conftest.py):
an equal key reuses a trace bound to the new model's own tensors; anything the trace reads that
differs (a config number, tying, mode, a hook, a plain attribute) traces again."""
import pytest
import torch

from autoshard import autoshard
from autoshard.compile import trace_cache
from autoshard.testing import build_model, max_rel
from autoshard.testing.models import VOCAB

IDS = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(3))


@pytest.fixture
def cache(monkeypatch):
    monkeypatch.setenv(trace_cache.ENV, "1")
    trace_cache.clear()
    yield trace_cache
    trace_cache.clear()


def _check(model) -> dict[str, int]:
    """Compile at tp=2; the program must give this model's logits. Returns the cache's counters."""
    prog = autoshard(model, tp=2, example_kwargs={"input_ids": IDS})
    assert max_rel(prog.simulate(input_ids=IDS).logits, model(input_ids=IDS).logits) <= 1e-5
    return trace_cache.stats()


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_a_second_model_of_the_same_build_reuses_the_trace_with_its_own_weights(cache, name):
    assert _check(build_model(name, seed=0)) == {"hits": 0, "misses": 1, "kept": 1}
    other = build_model(name, seed=1)            # other weights: the program must compute with them
    assert _check(other) == {"hits": 1, "misses": 1, "kept": 1}


def _epsilon(model):
    model.config.layer_norm_epsilon = 0.5        # a number in the graph, no shape changes
    for m in model.modules():
        if isinstance(m, torch.nn.LayerNorm):
            m.eps = 0.5


def _untie(model):
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())


def _hook(model):
    double = lambda mod, args, out: out * 2 if isinstance(out, torch.Tensor) else (out[0] * 2, *out[1:])  # noqa: E731
    model.transformer.h[0].register_forward_hook(double)


def _backward_hook(model):
    model.transformer.h[0].mlp.register_full_backward_hook(lambda mod, grad_in, grad_out: None)


def _eval(model):
    model.eval()


@pytest.mark.parametrize("change", [_epsilon, _untie, _hook, _backward_hook, _eval], ids=lambda f: f.__name__[1:])
def test_what_the_trace_reads_differs_so_it_traces_again(cache, change):
    _check(build_model("gpt2", seed=0))
    model = build_model("gpt2", seed=0)
    change(model)
    assert _check(model)["hits"] == 0            # and the program equals this model (in _check)


def test_a_plain_attribute_the_forward_branches_on_is_part_of_the_key(cache):
    class Scaled(torch.nn.Module):
        def __init__(self, double: bool):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)
            self.double = double

        def forward(self, x):
            return self.lin(x) * 2 if self.double else self.lin(x)

    x = torch.randn(2, 8)
    for double, hits in ((False, 0), (True, 0), (False, 1)):
        torch.manual_seed(0)
        model = Scaled(double)
        prog = autoshard(model, tp=2, example_inputs=(x,))
        assert max_rel(prog.simulate(x), model(x)) <= 1e-6
        assert trace_cache.stats()["hits"] == hits


def test_off_unless_asked(monkeypatch):
    monkeypatch.delenv(trace_cache.ENV, raising=False)
    trace_cache.clear()
    autoshard(build_model("gpt2"), tp=2, example_kwargs={"input_ids": IDS})
    autoshard(build_model("gpt2"), tp=2, example_kwargs={"input_ids": IDS})
    assert trace_cache.stats() == {"hits": 0, "misses": 0, "kept": 0}
