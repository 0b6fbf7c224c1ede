"""`autoshard train` past one machine (autoshard/train/cluster.py): torchrun's rendezvous flags,
running under a launcher that already started the ranks (torchrun, SLURM's srun), which ranks share a
node and the tensor-parallel groups that would cross one, and the SLURM job file."""
import os
import socket
import subprocess
import sys

import pytest

from autoshard.train import command, worker_argv
from autoshard.train.cluster import NodeLayout, launched_by, node_layout, rendezvous_args
from autoshard.train.options import TrainError, parse

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BASE = ["--data", os.path.join(ROOT, "README.md"), "--out", "unused", "--model", "llama"]


def test_a_launcher_that_started_the_ranks_is_recognised():
    assert launched_by({"RANK": "3", "WORLD_SIZE": "4"}) == ("torchrun", {})
    slurm = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_NTASKS_PER_NODE": "4(x2)",
             "MASTER_ADDR": "node01"}
    assert launched_by(slurm) == ("SLURM", {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
                                            "MASTER_PORT": "29500"})
    uneven = {**slurm, "SLURM_NTASKS_PER_NODE": "", "SLURM_NNODES": "2"}
    assert launched_by(uneven)[1]["LOCAL_WORLD_SIZE"] == "4"
    with pytest.raises(TrainError, match="started by srun .* MASTER_ADDR is not"):
        launched_by({k: v for k, v in slurm.items() if k != "MASTER_ADDR"})
    assert launched_by({"PATH": "/bin"}) is None


def test_tensor_parallel_groups_stay_inside_a_node_unless_asked():
    layout = NodeLayout(world=8, per_node=4)
    assert layout.describe() == "2 nodes x 4 processes (node 0: ranks 0-3; node 1: ranks 4-7)"
    layout.check_tp(2, allow=False)
    layout.check_tp(4, allow=False)
    with pytest.raises(TrainError, match=r"tp=8 with 4 processes per node: .* span two nodes.* tp dividing 4"):
        layout.check_tp(8, allow=False)
    layout.check_tp(8, allow=True)
    NodeLayout(world=4, per_node=4).check_tp(4, allow=False)
    assert NodeLayout(world=2, per_node=2).describe() == "one node, ranks 0-1"
    with pytest.raises(TrainError, match="tp=3 with 2 processes per node"):
        NodeLayout(world=6, per_node=2).check_tp(3, allow=False)


def test_the_rendezvous_flags_reach_torchruns_agent():
    from torch.distributed.run import config_from_args, get_args_parser
    two = rendezvous_args(2, "10.0.0.1:29400", "job7", 3, run_id="x", conf="join_timeout=900,keep_alive_interval=2")
    config, *_ = config_from_args(get_args_parser().parse_args(["--nproc-per-node=2", *two, "-m", "autoshard.train"]))
    assert (config.min_nodes, config.max_nodes, config.nproc_per_node) == (2, 2, 2)
    assert (config.rdzv_endpoint, config.run_id, config.max_restarts, config.rdzv_backend) == \
        ("10.0.0.1:29400", "job7", 3, "c10d")
    assert config.rdzv_configs["join_timeout"] == "900" and config.rdzv_configs["keep_alive_interval"] == "2"
    alone = rendezvous_args(None, None, "autoshard", 0, run_id="abc")
    config, *_ = config_from_args(get_args_parser().parse_args(["--nproc-per-node=2", *alone, "-m", "autoshard.train"]))
    assert (config.min_nodes, config.max_nodes, config.rdzv_endpoint, config.run_id) == (1, 1, "localhost:0", "abc")
    # the processes it starts are not given the launcher's flags again
    assert worker_argv(["--tp", "2", "--nnodes", "2", "--rdzv-endpoint=h:1", "--nproc-per-node", "2",
                        "--max-restarts", "1", "--rdzv-conf", "join_timeout=9", "--allow-cross-node-tp"]) == \
        ["--tp", "2", "--allow-cross-node-tp"]


def test_multi_node_options_are_checked():
    with pytest.raises(TrainError, match="--nnodes 2: the machines meet at --rdzv-endpoint"):
        parse([*BASE, "--nnodes", "2", "--nproc-per-node", "2"])
    with pytest.raises(TrainError, match="--nnodes launches --nproc-per-node processes on each machine"):
        parse([*BASE, "--nnodes", "2", "--rdzv-endpoint", "h:1"])
    with pytest.raises(TrainError, match="the node rank in 0..nnodes-1"):
        parse([*BASE, "--nnodes", "2", "--node-rank", "2", "--nproc-per-node", "2", "--rdzv-endpoint", "h:1"])
    with pytest.raises(TrainError, match="--slurm-script writes a job for --nnodes nodes x --nproc-per-node"):
        parse([*BASE, "--slurm-script", "job.sbatch"])


def test_the_slurm_job_file_is_valid_bash_that_meets_at_the_first_node(tmp_path, capsys):
    job = tmp_path / "job.sbatch"
    argv = [*BASE, "--tp", "2", "--steps", "3", "--device", "cuda", "--nnodes", "2", "--nproc-per-node", "4",
            "--slurm-script", str(job)]
    assert command(argv) == 0 and "sbatch " + str(job) in capsys.readouterr().out
    text = job.read_text()
    assert subprocess.run(["bash", "-n", str(job)]).returncode == 0
    assert "#SBATCH --nodes=2" in text and "#SBATCH --gpus-per-node=4" in text and "scontrol show hostnames" in text
    run = next(line for line in text.splitlines() if line.startswith("srun"))
    assert "-m autoshard.train" in run and "--tp 2 --steps 3" in run and "--slurm-script" not in run
    assert "--device cuda --resume --nnodes 2" in run
    assert "#SBATCH --requeue" in text          # a requeued job continues from the newest checkpoint
    assert '--nnodes 2 --nproc-per-node 4 --rdzv-endpoint "$head:$port"' in run


def test_the_job_file_survives_a_long_host_list(tmp_path):
    """Regression: the job file read the first host as `scontrol show hostnames | head -n1` under
    `set -o pipefail`; head's early exit killed scontrol with SIGPIPE when more lines were still to
    come, and the job stopped before srun (the two-node test failed so, now and then, on 2 hosts)."""
    job = tmp_path / "job.sbatch"
    assert command([*BASE, "--tp", "2", "--nnodes", "2", "--nproc-per-node", "2", "--slurm-script", str(job)]) == 0
    stubs = tmp_path / "bin"
    stubs.mkdir()
    (stubs / "scontrol").write_text('#!/bin/bash\nfor i in $(seq 20000); do echo "n$i"; done\n')
    (stubs / "srun").write_text('#!/bin/bash\necho "$@" > srun.args\n')
    for f in stubs.iterdir():
        f.chmod(0o755)
    env = {**os.environ, "PATH": f"{stubs}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "n[1-20000]",
           "AUTOSHARD_PORT": "29611"}
    proc = subprocess.run(["bash", str(job)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "--rdzv-endpoint n1:29611" in (tmp_path / "srun.args").read_text()


def test_under_srun_it_runs_as_the_given_rank_and_launches_nothing(tmp_path):
    """A simulated SLURM task (srun's variables set, no srun here): `autoshard train` with
    --nproc-per-node given runs as SLURM's rank 0 of 1 instead of starting processes of its own."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    env.update(SLURM_PROCID="0", SLURM_NTASKS="1", SLURM_LOCALID="0", SLURM_NTASKS_PER_NODE="1",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    argv = ["--data", os.path.join(ROOT, "README.md"), "--out", str(tmp_path), "--model", "llama", "--layers", "2",
            "--hidden", "64", "--heads", "4", "--seq-len", "32", "--batch", "2", "--steps", "2",
            "--nproc-per-node", "4"]
    proc = subprocess.run([sys.executable, "-m", "autoshard.train", *argv], capture_output=True, text=True,
                          timeout=600, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "started by SLURM (rank 0 of 1 is this node's first); running as the given ranks, no launch of our own" \
        in proc.stdout
    assert "tp=1 pp=1 dp=1" in proc.stdout and os.path.isfile(tmp_path / "metrics.csv")



def test_a_launcher_that_does_not_say_what_shares_a_node_is_taken_as_one_node():
    """RANK and WORLD_SIZE without LOCAL_WORLD_SIZE (some launchers set only those): one node, so a
    tp=2 is not refused as crossing nodes of one process each (LOCAL_WORLD_SIZE's default of 1 would)."""
    assert node_layout({"RANK": "0", "WORLD_SIZE": "4"}, world=4) == NodeLayout(4, 4)
    node_layout({"RANK": "0", "WORLD_SIZE": "4"}, world=4).check_tp(2, allow=False)
    assert node_layout({"LOCAL_WORLD_SIZE": "2"}, world=4) == NodeLayout(4, 2)


def test_an_out_folder_that_some_node_does_not_see_is_refused_naming_the_node(tmp_path):
    """Node-local disks: ranks 2-3 (node 1) given a folder of their own at "the same path" (here another
    folder, as a node-local disk mounted there would be) do not see what rank 0 writes, and every rank
    stops with one message naming node 1; one shared folder passes, and leaves nothing behind."""
    from autoshard.world import LocalWorld
    from autoshard.train.cluster import check_shared_folder
    layout = NodeLayout(world=4, per_node=2)
    shared, local = tmp_path / "shared", tmp_path / "node1"
    local.mkdir()

    def rank(r, folder_of):
        try:
            check_shared_folder(str(folder_of(r)), layout)
            return None
        except TrainError as e:
            return str(e)
    assert LocalWorld(4).run(lambda r: rank(r, lambda _: shared)) == [None] * 4
    assert os.listdir(shared) == []
    said = LocalWorld(4).run(lambda r: rank(r, lambda r: shared if r < 2 else local))
    for message in said:              # every rank stops, saying the same (its own --out path)
        assert "node 1 (ranks 2-3) cannot see the files rank 0 (node 0) writes there" in message, message
        assert "node-local --out is not supported" in message
