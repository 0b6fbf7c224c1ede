"""`autoshard train` (also `python -m autoshard.train`): from a model and text to a trained,
resumable, sharded run.

    autoshard train --model llama --layers 4 --hidden 256 --heads 4 --data corpus.txt \\
        --tp 2 --pp 2 --nproc-per-node 4 --steps 200 --out runs/llama

Files: options.py (the command line and its checks), model_source.py (--model: a transformers
model type, a local folder, module:factory), data.py (tokenizing, packing, per-rank batches),
lr.py (warm-up + cosine), loop.py (the job on each rank), metrics.py (progress, metrics.csv,
TensorBoard), plot.py (loss.png).
"""
from __future__ import annotations

import os
import subprocess
import sys

from autoshard.train.options import TrainError, TrainOptions, parse

__all__ = ["main", "worker_argv", "TrainError", "TrainOptions"]


def worker_argv(argv: list[str]) -> list[str]:
    """The arguments torchrun passes on to each process: without --nproc-per-node, and --virtual
    spelled --virtual-pipeline (torchrun reads a bare --virtual as a prefix of its own
    --virtual-local-rank)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--nproc-per-node":
            skip = True
        elif a.startswith("--nproc-per-node="):
            continue
        elif a == "--virtual" or a.startswith("--virtual="):
            out.append(a.replace("--virtual", "--virtual-pipeline", 1))
        else:
            out.append(a)
    return out


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        opts = parse(argv)
        if opts.nproc_per_node and "RANK" not in os.environ:        # launch torchrun, which runs us again
            if not opts.plan:
                from autoshard.train.loop import split_of
                split_of(opts, opts.nproc_per_node)                 # a world-size mismatch, said before launching
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   f"--nproc-per-node={opts.nproc_per_node}", "-m", "autoshard.train", *worker_argv(argv)]
            sys.exit(subprocess.run(cmd).returncode)
        from autoshard.train.loop import run
        code = run(opts)
    except TrainError as e:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"autoshard train: {e}", file=sys.stderr, flush=True)
        code = 2
    sys.stdout.flush()
    sys.stderr.flush()
    # gloo's worker threads may still hold tensors while the interpreter finalizes, which can abort
    # the process (see autoshard/testing/launch.py); the run is finished, so leave without it
    os._exit(code)
