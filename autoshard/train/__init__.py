"""`autoshard train` (also `python -m autoshard.train`): from a model and text to a trained,
resumable, sharded run.

    autoshard train --model llama --layers 4 --hidden 256 --heads 4 --data corpus.txt \\
        --tp 2 --pp 2 --nproc-per-node 4 --steps 200 --out runs/llama

Files: options.py (the command line and its checks), model_source.py (--model: a transformers
model type, a local folder, module:factory), data.py (tokenizing, packing, per-rank batches),
lr.py (warm-up + cosine), device.py (where each rank runs: GPU and NCCL or CPU and gloo, and the
defaults that follow), loop.py (the job on each rank), metrics.py (progress, metrics.csv,
TensorBoard), plot.py (loss.png).
"""
from __future__ import annotations

import os
import sys
import tempfile

from autoshard.train.cluster import launched_by, rendezvous_args, sbatch_script
from autoshard.train.options import TrainError, TrainOptions, parse

__all__ = ["ERRORS", "command", "failure_line", "main", "worker_argv", "TrainError", "TrainOptions"]

ERRORS = "AUTOSHARD_TRAIN_ERRORS"     # the folder where launched ranks write why they stopped
NO_SHARED_STORE = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"     # restartable agents: see _launch


# the launcher's own flags (each with a value): the processes it starts are not given them again
LAUNCHER_FLAGS = ("--nproc-per-node", "--nnodes", "--node-rank", "--rdzv-endpoint", "--rdzv-id", "--rdzv-conf",
                  "--max-restarts",
                  "--slurm-script")


def worker_argv(argv: list[str], drop: tuple[str, ...] = LAUNCHER_FLAGS) -> list[str]:
    """The arguments torchrun passes on to each process: without the launcher's flags (`drop`), and
    --virtual spelled --virtual-pipeline (torchrun reads a bare --virtual as a prefix of its own
    --virtual-local-rank)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in drop:
            skip = True
        elif a.split("=", 1)[0] in drop:
            continue
        elif a == "--virtual" or a.startswith("--virtual="):
            out.append(a.replace("--virtual", "--virtual-pipeline", 1))
        else:
            out.append(a)
    return out


def _launch(opts: TrainOptions, argv: list[str]) -> int:
    """Check what can be checked here, then run the job on --nproc-per-node processes, as torchrun
    --standalone does but in this process: a failed run ends in one line, not torchrun's report.
    A rank that stops on a TrainError writes why into a folder this launcher gives it (ERRORS) and
    exits 2; the launcher says the lowest rank's reason once (`failure_line`). Before, rank 0 printed
    it, and when another rank failed first the agent stopped rank 0 before it could: exit 2, nothing
    said."""
    import logging
    import uuid

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args, get_args_parser

    import torch

    from autoshard.train.device import placement
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    placement(opts, {"LOCAL_WORLD_SIZE": str(opts.nproc_per_node)}, gpus)     # --device cuda without GPUs enough
    _check_before_ranks(opts)
    rendezvous = rendezvous_args(opts.nnodes, opts.rdzv_endpoint, opts.rdzv_id, opts.max_restarts,
                                 run_id=str(uuid.uuid4()), conf=opts.rdzv_conf)     # without --nnodes: torchrun --standalone's
    args = get_args_parser().parse_args([f"--nproc-per-node={opts.nproc_per_node}", *rendezvous, "-m",
                                         "autoshard.train", *worker_argv(argv)])
    os.environ.setdefault("OMP_NUM_THREADS", "1")          # torchrun's default, without its warning (run() sets threads)
    if opts.max_restarts:
        # torch 2.13's c10d rendezvous keeps the first round's store address on each agent that shares
        # its TCPStore with the ranks; a node that joins a later round (a lost node's replacement) then
        # waits for an address nobody writes (pytorch/pytorch#135712). Without sharing, every round
        # publishes its own.
        os.environ.setdefault(NO_SHARED_STORE, "1")
    config, entrypoint, entry_args = config_from_args(args)
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)    # the failure is said below
    with tempfile.TemporaryDirectory(prefix="autoshard-train-") as folder:
        os.environ[ERRORS] = folder                         # the ranks inherit it
        try:
            elastic_launch(config, entrypoint)(*entry_args)
        except ChildFailedError as e:
            codes = {rank: f.exitcode for rank, f in e.failures.items()}
            print(failure_line(codes, folder), file=sys.stderr)
            return 2 if 2 in codes.values() else 1
        finally:
            del os.environ[ERRORS]
    return 0


def _check_before_ranks(opts: TrainOptions) -> None:
    """What can be found before any rank starts: a world size the split does not fit, bad data (said
    in seconds, and tokenized once for every rank)."""
    from autoshard.train.data import tokenizer_for
    from autoshard.train.loop import check_data, split_of
    if not opts.plan:                               # the world is every node's processes
        split_of(opts, opts.nproc_per_node * (opts.nnodes or 1))
    check_data(opts, tokenizer_for(opts.model))


def _in_process(opts: TrainOptions) -> int:
    """--in-process: the --nproc-per-node ranks as threads of this process on a local world, checked
    first as a launch is; a rank's TrainError stops every rank and is said once."""
    import dataclasses

    from autoshard.train.loop import run
    from autoshard.world import LocalWorld
    opts = dataclasses.replace(opts, device="cpu")
    _check_before_ranks(opts)
    return max(LocalWorld(opts.nproc_per_node).run(lambda rank: run(opts)))


def failure_line(codes: dict[int, int], folder: str) -> str:
    """What the launcher says when ranks failed (`codes`: rank -> exit code): the reason a rank
    wrote into `folder` (the lowest such rank), else which rank failed first."""
    said = sorted((int(name[5:-4]), name) for name in os.listdir(folder) if name.startswith("rank-"))
    if said:
        with open(os.path.join(folder, said[0][1])) as f:
            return f"autoshard train: {f.read()}"
    rank, code = min(codes.items())
    return f"autoshard train: rank {rank} failed (exit code {code}); its output is above"


def _say(error: TrainError) -> None:
    """A rank's TrainError: into the launcher's folder when there is one, else (a rank started by
    torchrun itself, or one process) rank 0 prints it."""
    folder, rank = os.environ.get(ERRORS), os.environ.get("RANK", "0")
    if folder and os.path.isdir(folder):
        with open(os.path.join(folder, f"rank-{rank}.txt"), "w") as f:
            f.write(str(error))
    elif rank == "0":
        print(f"autoshard train: {error}", file=sys.stderr, flush=True)


def _write_slurm_script(opts: TrainOptions, argv: list[str]) -> int:
    """--slurm-script: the job file for this training on --nnodes x --nproc-per-node, nothing run."""
    text = sbatch_script(worker_argv(argv), nodes=opts.nnodes, per_node=opts.nproc_per_node,
                         gpus=opts.device != "cpu", python=sys.executable)
    with open(opts.slurm_script, "w") as f:
        f.write(text)
    os.chmod(opts.slurm_script, 0o755)
    print(f"autoshard train: wrote {opts.slurm_script} ({opts.nnodes} nodes x {opts.nproc_per_node} processes); "
          f"submit it with: sbatch {opts.slurm_script}", flush=True)
    return 0


def command(argv: list[str]) -> int:
    """`autoshard train ARGV`'s work and exit status, without leaving the process (main() leaves)."""
    try:
        opts = parse(argv)
        if opts.slurm_script:
            return _write_slurm_script(opts, argv)
        started = launched_by(os.environ)
        if started is not None:
            os.environ.update(started[1])           # srun's variables, as torch.distributed reads them
            # each node's first rank says so, in that node's log (not the ranks _launch started)
            if os.environ.get("LOCAL_RANK", os.environ["RANK"]) == "0" and ERRORS not in os.environ:
                print(f"autoshard train: started by {started[0]} (rank {os.environ['RANK']} of "
                      f"{os.environ['WORLD_SIZE']} is this node's first); running as the given ranks, no launch "
                      f"of our own", flush=True)
        if opts.in_process:
            return _in_process(opts)
        if opts.nproc_per_node and started is None:      # launch the ranks, which run us again
            return _launch(opts, argv)
        from autoshard.train.loop import run
        return run(opts)
    except TrainError as e:
        _say(e)
        return 2


def main(argv: list[str] | None = None) -> None:
    code = command(list(sys.argv[1:] if argv is None else argv))
    sys.stdout.flush()
    sys.stderr.flush()
    # gloo's worker threads may still hold tensors while the interpreter finalizes, which can abort
    # the process (see autoshard/testing/launch.py); the run is finished, so leave without it
    os._exit(code)
