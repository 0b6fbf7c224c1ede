"""Where `autoshard train`'s ranks come from past one machine: torchrun's flags for several nodes, a
launcher that already started every process (torchrun, SLURM's srun), which ranks share a node,
whether every node sees the run's folder, and a SLURM job file that runs the same training.

    extra = launched_by(os.environ)          # ("SLURM", {"RANK": ...}) when srun started this process
    layout = NodeLayout(world=8, per_node=4); layout.check_tp(tp=2, allow=False)
    check_shared_folder(opts.out, layout)    # a collective: a node on a disk of its own stops every rank
    text = sbatch_script(argv, nodes=2, per_node=8, gpus=True)

torchrun and torch.distributed are the engine: the flags are torchrun's own (its elastic agent's
c10d rendezvous), passed through; nothing here starts a process.
"""
from __future__ import annotations

import os
import re
import shlex
import uuid
from collections.abc import Mapping
from dataclasses import dataclass

from autoshard.runtime.json_gather import all_gather_json
from autoshard.train.options import TrainError
from autoshard.world import current

__all__ = ["NodeLayout", "check_shared_folder", "launched_by", "node_layout", "rendezvous_args", "sbatch_script"]


def launched_by(env: Mapping[str, str]) -> tuple[str, dict[str, str]] | None:
    """Which launcher started this process already, and the torch.distributed variables to set from
    its own (none for torchrun, which sets them): SLURM's srun sets SLURM_PROCID, SLURM_NTASKS and
    SLURM_LOCALID (MASTER_ADDR is the job script's); None when no launcher did (launch, as today)."""
    if "RANK" in env and "WORLD_SIZE" in env:
        return "torchrun", {}
    if all(k in env for k in ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID")):
        if "MASTER_ADDR" not in env:
            raise TrainError("started by srun (SLURM_PROCID is set) but MASTER_ADDR is not: set it to the first "
                             "node's address in the job script (e.g. $(scontrol show hostnames | head -n1)), or "
                             "let torchrun start the ranks (autoshard train --slurm-script writes such a script)")
        tasks = int(env["SLURM_NTASKS"])
        per_node = env.get("SLURM_NTASKS_PER_NODE")
        if per_node:                  # "4", or "4(x2)": four tasks on each of two nodes
            local = int(re.match(r"\d+", per_node).group())
        else:
            local = tasks // int(env.get("SLURM_NNODES", env.get("SLURM_JOB_NUM_NODES", "1")))
        return "SLURM", {"RANK": env["SLURM_PROCID"], "WORLD_SIZE": str(tasks), "LOCAL_RANK": env["SLURM_LOCALID"],
                         "LOCAL_WORLD_SIZE": str(local), "MASTER_PORT": env.get("MASTER_PORT", "29500")}
    return None


@dataclass(frozen=True)
class NodeLayout:
    """`world` ranks, `per_node` to a machine, numbered node by node (torchrun's and srun's order)."""
    world: int
    per_node: int

    @property
    def nodes(self) -> int:
        return -(-self.world // self.per_node)

    def describe(self) -> str:
        if self.nodes == 1:
            return f"one node, ranks 0-{self.world - 1}"
        spans = [f"node {n}: {self.ranks_of(n)}" for n in range(self.nodes)]
        return f"{self.nodes} nodes x {self.per_node} processes ({'; '.join(spans)})"

    def node_of(self, rank: int) -> int:
        return rank // self.per_node

    def ranks_of(self, node: int) -> str:
        return f"ranks {node * self.per_node}-{min(self.world, (node + 1) * self.per_node) - 1}"

    def check_tp(self, tp: int, allow: bool) -> None:
        """Tensor-parallel ranks are adjacent (runtime/mesh.py): a group stays inside a node when
        the processes per node are a multiple of tp. Otherwise every layer's all-reduces cross the
        network: refused unless asked for."""
        if self.nodes > 1 and self.per_node % tp and not allow:
            raise TrainError(f"tp={tp} with {self.per_node} processes per node: tensor-parallel groups of {tp} "
                             f"adjacent ranks would span two nodes, and each layer's all-reduces would cross the "
                             f"network; use a tp dividing {self.per_node} (pp and dp cross nodes instead), or "
                             f"--allow-cross-node-tp")


def node_layout(env: Mapping[str, str], world: int) -> NodeLayout:
    """This run's layout from its launcher's LOCAL_WORLD_SIZE (torchrun's, or srun's mapped); a
    launcher that does not set it is taken as one node (nothing is known to cross one)."""
    return NodeLayout(world, int(env.get("LOCAL_WORLD_SIZE", world)))


def check_shared_folder(folder: str, layout: NodeLayout) -> None:
    """Every rank must see what rank 0 writes under `folder` (--out): checkpoints are one file per
    rank and an index rank 0 writes last, and the data is tokenized once, by rank 0. Rank 0 writes a
    file there and every rank looks for it; a node on a disk of its own (the same path, another
    disk) does not see it, and every rank stops naming the nodes. A collective: every rank calls it."""
    world = current()
    if world.size() == 1:
        return
    name = None
    if world.rank() == 0:
        os.makedirs(folder, exist_ok=True)
        name = f".shared-{uuid.uuid4().hex}"
        with open(os.path.join(folder, name), "w") as f:
            f.write("written by rank 0; every rank looks for it\n")
    name = all_gather_json(name)[0]
    seen = all_gather_json(os.path.isfile(os.path.join(folder, name)))
    if world.rank() == 0:
        os.remove(os.path.join(folder, name))
    blind = sorted({layout.node_of(r) for r, ok in enumerate(seen) if not ok})
    if blind:
        where = ", ".join(f"node {n} ({layout.ranks_of(n)})" for n in blind)
        raise TrainError(f"--out {folder}: {where} cannot see the files rank 0 (node 0) writes there, so it is not "
                         f"one folder shared by every node: checkpoints (a file per rank, the index written last by "
                         f"rank 0) and the tokenized data need a file system every node mounts at this path (NFS, "
                         f"Lustre, ...); a node-local --out is not supported")


def rendezvous_args(nnodes: int | None, endpoint: str | None, rdzv_id: str, max_restarts: int,
                    run_id: str, conf: str | None = None) -> list[str]:
    """torchrun's rendezvous flags: standalone on this machine (a free port) when `nnodes` is not
    given, else c10d at `endpoint` for `nnodes` agents (c10d numbers the nodes in the order they
    join: a node rank is not passed, torchrun would ignore it)."""
    extra = [f"--max-restarts={max_restarts}"] + ([f"--rdzv-conf={conf}"] if conf else [])
    if nnodes is None:
        return ["--rdzv-backend=c10d", "--rdzv-endpoint=localhost:0", f"--rdzv-id={run_id}", *extra]
    return [f"--nnodes={nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={rdzv_id}", *extra]


def sbatch_script(train_argv: list[str], *, nodes: int, per_node: int, gpus: bool, python: str = "python",
                  port: int = 29500) -> str:
    """A SLURM job file for `nodes` x `per_node` processes: one srun task per node runs this
    training through `autoshard train`'s own launcher (torchrun's elastic agent), meeting at the
    first node of the allocation (`scontrol show hostnames`)."""
    # --resume: a job SLURM requeues (a lost node ends the job step: srun --kill-on-bad-exit)
    # continues from --out's newest complete checkpoint; the first run finds none and starts at 0
    args = " ".join(shlex.quote(a) for a in [*train_argv, *([] if "--resume" in train_argv else ["--resume"])])
    lines = ["#!/bin/bash", "#SBATCH --job-name=autoshard-train", f"#SBATCH --nodes={nodes}",
             "#SBATCH --ntasks-per-node=1", "#SBATCH --requeue"]
    if gpus:
        lines.append(f"#SBATCH --gpus-per-node={per_node}")
    lines += ["set -euo pipefail",
              # no pipe into `head -n1`: under pipefail its early exit can kill scontrol (SIGPIPE) and the job
              'hosts=($(scontrol show hostnames "$SLURM_JOB_NODELIST"))',
              'head=${hosts[0]}',
              f'port=${{AUTOSHARD_PORT:-{port}}}',
              "# one agent per node; they meet at the first node (c10d) and number the ranks node by node",
              f'srun --kill-on-bad-exit=1 {python} -m autoshard.train {args} --nnodes {nodes} '
              f'--nproc-per-node {per_node} --rdzv-endpoint "$head:$port" --rdzv-id "${{SLURM_JOB_ID:-autoshard}}"',
              ""]
    return "\n".join(lines)
