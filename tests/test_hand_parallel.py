"""The hand-parallel baseline computes what the single-device model and autoshard compute."""
import json
import os
import subprocess
import sys

import pytest
import torch

from autoshard.models import GPT, GPTConfig
from benchmarks.hand_parallel.layers import vocab_parallel_cross_entropy

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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


def test_parallel_gpt_refuses_an_indivisible_split():
    from benchmarks.hand_parallel.gpt import ParallelGPT
    model = GPT(GPTConfig(n_layer=1, n_head=4, n_embd=64, vocab_size=100, block_size=16))
    with pytest.raises(ValueError, match="t=3 must divide n_head=4 and vocab_size=100"):
        ParallelGPT(model, 0, 3, group=object())


@pytest.mark.slow
def test_hand_parallel_and_autoshard_train_alike_on_gloo():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           os.path.join(ROOT, "benchmarks", "step_time.py"), "--tp", "2", "--rounds", "2", "--warmup", "0",
           "--layers", "2", "--hidden", "64", "--heads", "4", "--vocab", "256", "--seq", "32", "--lr", "0.5"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (r,) = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert r["all_ranks_ok"] and r["loss_rel"] <= 1e-5
    first, _, last = (a for a, _ in r["losses"])
    assert first != last            # the steps trained: the comparison is of moving values
