"""`autoshard verify --gloo`: the certificate's runtime run in real processes passes on a correct split
(the runtime bugs of tests/harness/verify_gloo_mutations.py fail the same run on a local world:
tests/local/test_verify_runtime.py)."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMALL = ["--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "2", "--vocab", "128",
         "--max-positions", "64"]


def test_verify_gloo_certifies_pp2_in_two_processes():
    """pp=2: the transfers between stages are what gloo runs differently from a local world (its
    collectives are the parity tests' in tests/distributed/test_distributed.py)."""
    run = subprocess.run([sys.executable, "-m", "autoshard.cli", "verify", "--model", "llama", *SMALL,
                          "--pp", "2", "--gloo"], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "gloo, 2 processes" in run.stdout and "loss (gloo)" in run.stdout
    assert "(gloo rank 1, step" in run.stdout                                          # the last stage's rank
    assert "step 2 (unpadded)" in run.stdout or "step 4 (packed)" in run.stdout         # and several steps
    assert run.stdout.strip().splitlines()[-1].startswith("VERIFIED")
