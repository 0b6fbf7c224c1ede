"""The hand-parallel baseline computes what the single-device model and autoshard compute."""
import pytest
import torch

from autoshard.models import GPT, GPTConfig
from benchmarks.hand_parallel.layers import vocab_parallel_cross_entropy
from tests.launches import Job, needs


@pytest.mark.simulation
def test_vocab_parallel_cross_entropy_at_t1_is_cross_entropy(monkeypatch):
    """With one rank the collectives are identities: the loss and its gradient are PyTorch's."""
    import torch.distributed as dist
    monkeypatch.setattr(dist, "all_reduce", lambda t, op=None, group=None: t)
    logits = torch.randn(12, 50, dtype=torch.float64, requires_grad=True)
    target = torch.randint(0, 50, (12,))
    ours = vocab_parallel_cross_entropy(logits, target, 0, None)
    (g_ours,) = torch.autograd.grad(ours, logits)
    ref = torch.nn.functional.cross_entropy(logits, target)
    (g_ref,) = torch.autograd.grad(ref, logits)
    assert torch.allclose(ours, ref) and torch.allclose(g_ours, g_ref)


@pytest.mark.unit
def test_parallel_gpt_refuses_an_indivisible_split():
    from benchmarks.hand_parallel.gpt import ParallelGPT
    model = GPT(GPTConfig(n_layer=1, n_head=4, n_embd=64, vocab_size=100, block_size=16))
    with pytest.raises(ValueError, match="t=3 must divide n_head=4 and vocab_size=100"):
        ParallelGPT(model, 0, 3, group=object())


@pytest.mark.simulation
def test_parallel_gpt_at_t1_is_the_model(monkeypatch):
    """One rank: the hand-written layers compute the single-device model's loss and gradients."""
    import torch.distributed as dist

    from benchmarks.hand_parallel.gpt import ParallelGPT
    monkeypatch.setattr(dist, "all_reduce", lambda t, op=None, group=None: t)
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=4, n_embd=32, vocab_size=64, block_size=16))
    hand = ParallelGPT(model, 0, 1, group=object())
    ids, targets = torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))
    want, got = model(ids, targets)[1], hand(ids, targets)[1]
    want.backward()
    got.backward()
    assert torch.allclose(got, want, rtol=1e-6)
    assert torch.allclose(hand.h[1].mlp.fc.weight.grad, model.h[1].mlp.c_fc.weight.grad, rtol=1e-5, atol=1e-7)


def test_run_all_launches_each_config_with_its_world_size():
    from benchmarks.run_all import commands
    steps = [c for c in commands(quick=True, append=True) if "step_time.py" in " ".join(c)]
    worlds = [next(a for a in c if a.startswith("--nproc-per-node=")) for c in steps]
    assert worlds == ["--nproc-per-node=2", "--nproc-per-node=2", "--nproc-per-node=4"]
    assert all("--append" not in c for c in commands(quick=True, append=True))      # quick never records


def _step_time(name: str, world: int, *args: str) -> Job:
    """benchmarks/step_time.py's command line as a job of the suite's launch of `world` processes."""
    return Job(f"step-time/{name}", "benchmarks.step_time:cli",
               (*args, "--rounds", "2", "--warmup", "0", "--layers", "4", "--hidden", "64", "--heads", "4",
                "--vocab", "256", "--seq", "32", "--lr", "0.5", "--batch", "8"), world, local=False)   # step times


TP2 = _step_time("tp2", 2, "--tp", "2")
TP2_PP2 = _step_time("tp2-pp2-v2", 4, "--tp", "2", "--pp", "2", "--virtual-pipeline", "2", "--schedule", "interleaved",
                     "--microbatches", "4")


def _checked(lines: list[dict]) -> dict:
    (r,) = lines
    assert r["all_ranks_ok"] and r["loss_rel"] <= 1e-5
    first, _, last = (a for a, _ in r["losses"])
    assert first != last            # the steps trained: the comparison is of moving values
    return r


@pytest.mark.slow
@needs(TP2)
def test_hand_parallel_and_autoshard_train_alike_on_gloo(launched):
    assert _checked(launched(TP2))["config"] == "tp=2"


@pytest.mark.slow
@needs(TP2_PP2)
def test_hand_built_pipeline_and_autoshard_train_alike_on_gloo(launched):
    """tp=2 x pp=2 with two chunks per rank (interleaved 1F1B): hand stages, hand p2p and the
    embedding group against autoshard's pipeline runtime."""
    assert _checked(launched(TP2_PP2))["config"] == "tp=2 pp=2 v=2 m=4"
