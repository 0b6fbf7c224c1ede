"""Tier (c): real processes on gloo, launched by torchrun, each running only its own rank."""
import json
import os
import subprocess
import sys

import pytest


@pytest.mark.slow
@pytest.mark.parametrize("in_graph_loss", [False, True], ids=["gathered-logits", "vocab-parallel-loss"])
@pytest.mark.parametrize("world", [2, 4])
def test_gloo_training_matches_single_device(world, in_graph_loss):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
           "-m", "autoshard.testing.dist_check", "--steps", "3"] + (["--in-graph-loss"] if in_graph_loss else [])
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert {r["model"] for r in lines} == {"nanogpt", "gpt2", "llama", "bert"}
    for r in lines:
        assert r["world"] == world and r["all_ranks_ok"], r
        assert r["loss_rel"] <= 1e-5 and r["param_rel"] <= 1e-5, r
        assert r["sharded"] > 0, r
