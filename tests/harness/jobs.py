"""Several checkers in one torchrun launch (autoshard.testing.launch.torchrun_jobs builds it):

    torchrun --standalone --nproc-per-node 4 -m tests.harness.jobs JOBS.json

JOBS.json is a list of [module, [arguments...]]; each module is a checker whose `main()` parses its
arguments and runs through `launch.run_checker`. Here the process group is made once and each
checker runs in it in turn (its verdict recorded, no exit), so torch, transformers and the
compiler's first export are paid once per launch instead of once per checker. Rank 0 prints
{"job": i} before job i's own lines. Exit status 0 when every job's check passed on every rank.
"""
from __future__ import annotations

import importlib
import json
import os
import sys

import torch.distributed as dist

from autoshard.testing import launch


def main() -> None:
    with open(sys.argv[1]) as f:
        jobs = json.load(f)
    launch.start_shared()
    for i, (module, argv) in enumerate(jobs):
        if dist.get_rank() == 0:
            print(json.dumps({"job": i}), flush=True)
        sys.argv = [module, *argv]
        importlib.import_module(module).main()
    ok = launch.shared_ok()
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if ok else 1)      # as run_checker leaves: gloo's threads can abort finalization


if __name__ == "__main__":
    main()
