"""`autoshard train` on a GPU: each process on its own GPU with NCCL and bf16 by default, CUDA
memory in metrics.csv; a folder's model (loaded on the CPU) moved to the GPU and trained with the
fused kernels (--fuse). Skipped without a GPU (tests/unit/test_train_device.py checks the choices
on the CPU)."""
import csv
import math
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


LLAMA = ["--model", "llama", "--layers", "2", "--hidden", "128", "--heads", "4"]


def _train(out, *args, model=LLAMA) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "autoshard.train", "--data", os.path.join(ROOT, "README.md"), "--out", str(out),
           *model, "--seq-len", "64", "--batch", "8", "--steps", "6", "--warmup", "2", "--lr", "1e-3",
           "--log-every", "1", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_train_on_one_gpu_defaults_to_bf16_nccl_and_reports_memory(tmp_path):
    out = _train(tmp_path, "--nproc-per-node", "1", "--export", str(tmp_path / "hf")).stdout
    assert "bf16 with fp32 main weights" in out and "GiB peak" in out, out
    with open(tmp_path / "metrics.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == 6 and all(math.isfinite(float(r["loss"])) and float(r["cuda_peak_gib"]) > 0 for r in rows)
    _train(tmp_path / "again", "--nproc-per-node", "1", "--fuse", model=["--model", str(tmp_path / "hf")])  # loaded, moved


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_train_on_two_gpus_at_tp2(tmp_path):
    out = _train(tmp_path, "--nproc-per-node", "2", "--tp", "2").stdout
    assert "tp=2" in out and "GiB peak" in out, out
