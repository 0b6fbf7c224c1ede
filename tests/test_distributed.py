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


PIPELINES = ["tp1-pp2-dp1-v1", "tp1-pp4-dp1-v2", "tp2-pp2-dp1-v2", "tp2-pp2-dp2-v1"]   # (tp, pp, dp, v)


@pytest.mark.slow
@pytest.mark.parametrize("config", PIPELINES)
def test_gloo_pipeline_training_matches_single_device(config, tmp_path):
    """GPT-2 and Llama, 8 layers, 10 AdamW steps with gradient clipping on one global batch per step."""
    tp, pp, dp, v = (int(part[2:] if part[0] != "v" else part[1:]) for part in config.split("-"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={tp * pp * dp}",
           "-m", "autoshard.testing.pipeline_check", "--tp", str(tp), "--pp", str(pp), "--dp", str(dp),
           "--chunks", str(v), "--microbatches", str(2 * pp), "--steps", "10", "--trace", str(tmp_path)]
    if dp > 1:      # SGD too: linear in the gradients, so parameters must match element by element
        cmd += ["--optim", "adamw", "sgd"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert {(r["model"], r["optim"]) for r in lines} >= {("gpt2", "adamw"), ("llama", "adamw")}
    for r in lines:
        assert r["all_ranks_ok"] and (r["tp"], r["pp"], r["dp"], r["virtual"]) == (tp, pp, dp, v), r
        assert r["loss_rel"] <= 1e-5 and r["grad_norm_rel"] <= 1e-5 and r["param_norm_rel"] <= 1e-5, r
        assert r["params_here"] < r["params_total"], r       # a pipeline rank holds only its stages
        assert r["optim"] == "adamw" or r["param_rel"] <= 1e-5, r
        trace = json.load(open(tmp_path / f"{r['model']}_tp{tp}_pp{pp}_dp{dp}_v{v}.json"))
        assert sum(e["ph"] == "X" for e in trace["traceEvents"]) == 2 * tp * pp * dp * v * 2 * pp
        assert (tmp_path / f"{r['model']}_tp{tp}_pp{pp}_dp{dp}_v{v}.png").read_bytes()[:4] == b"\x89PNG"
