"""`autoshard verify --gloo`: the certificate's runtime run in real processes passes on a correct split
(the runtime bugs of tests/harness/verify_gloo_mutations.py fail the same run on a local world:
tests/local/test_verify_runtime.py)."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMALL = ["--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "2", "--vocab", "128",
         "--max-positions", "64"]


def test_verify_gloo_certifies_pp2_in_two_processes_on_two_machines():
    """pp=2: the transfers between stages are what gloo runs differently from a local world (its
    collectives are the parity tests' in tests/distributed/test_distributed.py). Its two processes
    on two "machines": two verify commands on localhost, each with --nnodes 2 and one process, meet
    at a c10d rendezvous; each prints the whole certificate (every rank's rows reach both)."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "autoshard.cli", "verify", "--model", "llama", *SMALL, "--pp", "2", "--gloo",
           "--nnodes", "2", "--rdzv-endpoint", f"127.0.0.1:{port}"]
    nodes = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
             for _ in range(2)]
    said = [node.communicate(timeout=600) for node in nodes]
    for node, (out, err) in zip(nodes, said):
        assert node.returncode == 0, out[-3000:] + err[-3000:]
        assert "gloo, 2 processes on 2 machines" in out and "loss (gloo)" in out
        assert "(gloo rank 1, step" in out                                          # the last stage's rank
        assert "step 2 (unpadded)" in out or "step 4 (packed)" in out               # and several steps
        assert out.strip().splitlines()[-1].startswith("VERIFIED")
    rows = [[line for line in out.splitlines() if "(gloo rank" in line] for out, _ in said]
    assert rows[0] and rows[0] == rows[1]


def test_verify_on_machines_needs_gloo_and_a_split_they_divide(capsys):
    from autoshard.verify.command import main
    assert main(["--model", "llama", *SMALL, "--pp", "2", "--nnodes", "2", "--rdzv-endpoint", "h:1"]) == 2
    assert "--nnodes 2: machines run the certificate's runtime steps with --gloo" in capsys.readouterr().err
    assert main(["--model", "llama", *SMALL, "--pp", "2", "--gloo", "--nnodes", "3", "--rdzv-endpoint", "h:1"]) == 2
    assert "the split's 2 processes do not divide evenly over 3 machines" in capsys.readouterr().err
    assert main(["--model", "llama", *SMALL, "--pp", "2", "--gloo", "--nnodes", "2"]) == 2
    assert "the machines meet at --rdzv-endpoint HOST:PORT" in capsys.readouterr().err
