"""Single-process benchmarks as pytest-benchmark tests, each group two rows measured side by side in
one run (compare within a group, never across runs: these machines are shared and noisy).

    .venv/bin/python -m pytest benchmarks/bench_single_process.py -o python_files='bench_*.py'
    (./run bench runs it; --benchmark-disable runs each body once, as a smoke test)

- compile: autoshard on a meta-device GPT-2 (4 layers, tp=4; rank 0 built) against torch.export alone.
- step: one simulated training step (forward, backward) of Llama at tp=2 against the model's own.
- kernels (CUDA only): fused bias + GeLU against eager torch on one activation tensor.
Each benchmark also checks what it ran (the simulated loss equals the model's, the fused op its
torch implementation), so a fast wrong answer fails.
"""
from __future__ import annotations

import os

import pytest
import torch

from autoshard import autoshard
from autoshard.compile import trace_cache
from autoshard.testing.metrics import max_rel
from autoshard.testing.models import build_model

os.environ.pop(trace_cache.ENV, None)   # compile time is what is measured: every compile traces


def _meta_gpt2(layers: int = 4):
    import transformers as hf
    with torch.device("meta"):
        return hf.GPT2LMHeadModel(hf.GPT2Config(n_layer=layers, n_embd=768, n_head=12, vocab_size=50257))


@pytest.mark.benchmark(group="compile: GPT-2 4 layers on meta")
def test_compile_autoshard_tp4(benchmark):
    assert benchmark(lambda: autoshard(_meta_gpt2(), tp=4).rank(0)).tp == 4     # inputs inferred, dynamic


@pytest.mark.benchmark(group="compile: GPT-2 4 layers on meta")
def test_compile_torch_export_alone(benchmark):
    """torch.export with the dynamic batch and length autoshard asks it for (compile_scaling.py's settings)."""
    from torch.export import Dim
    kw = {"input_ids": torch.zeros(2, 64, dtype=torch.long), "use_cache": False}
    dyn = {"input_ids": {0: Dim.AUTO, 1: Dim.AUTO}, "use_cache": None}
    benchmark(lambda: torch.export.export(_meta_gpt2(), (), kw, dynamic_shapes=dyn, strict=False))


def _batch():
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 128, (4, 32), generator=gen)
    return {"input_ids": ids, "labels": ids}


@pytest.mark.benchmark(group="step: Llama 4 layers, forward and backward")
def test_step_simulated_tp2(benchmark):
    model, ref, batch = build_model("llama", layers=4), build_model("llama", layers=4), _batch()
    prog = autoshard(model, tp=2, example_kwargs=batch)

    def step():
        loss = prog.simulate(**batch).loss
        loss.backward()
        return loss
    assert max_rel(benchmark(step), ref(**batch).loss) < 1e-5


@pytest.mark.benchmark(group="step: Llama 4 layers, forward and backward")
def test_step_single_device_model(benchmark):
    model, batch = build_model("llama", layers=4), _batch()
    benchmark(lambda: model(**batch).loss.backward())


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the kernels are CuPy)")


@needs_cuda
@pytest.mark.benchmark(group="kernels: bias + GeLU, 8192 x 4096 bf16")
@pytest.mark.parametrize("impl", ["fused", "eager"])
def test_bias_gelu(benchmark, impl):
    from autoshard.kernels import ops
    x = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    want = torch.nn.functional.gelu(x + b, approximate="tanh")

    def run():
        out = ops.bias_gelu(x, b) if impl == "fused" else torch.nn.functional.gelu(x + b, approximate="tanh")
        torch.cuda.synchronize()
        return out
    assert max_rel(benchmark(run).float(), want.float()) < 1e-2
