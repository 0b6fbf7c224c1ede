"""Tier (c): real processes on gloo, launched by torchrun, each running only its own rank."""
import json
import os
import subprocess
import sys

import pytest

MODES = {"gathered-logits": [], "vocab-parallel-loss": ["--in-graph-loss"],
         "sequence-parallel": ["--in-graph-loss", "--sequence-parallel"]}


@pytest.mark.slow
@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("world", [2, 4])
def test_gloo_training_matches_single_device(world, mode):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
           "-m", "autoshard.testing.dist_check", "--steps", "3", *MODES[mode]]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert {r["model"] for r in lines} == {"nanogpt", "gpt2", "llama", "bert"}
    for r in lines:
        assert r["world"] == world and r["all_ranks_ok"], r
        assert r["loss_rel"] <= 1e-5 and r["param_rel"] <= 1e-5, r
        assert r["sharded"] > 0, r
