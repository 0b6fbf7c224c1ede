"""Several checkers in one torchrun launch (tests/launches.py builds it, one per world size):

    torchrun --standalone --nproc-per-node 4 -m tests.harness.jobs JOBS.json

JOBS.json is a list of [module, [arguments...]]; each module is a checker whose `main()` parses its
arguments and runs through `launch.run_checker` ("module:function" names another entry point, such
as a benchmark script's `cli`). Here the process group is made once and each
checker runs in it in turn (its verdict recorded, no exit), so torch, transformers and the
compiler's first export are paid once per launch instead of once per checker. Rank 0 prints
{"job": i} before job i's own lines and {"done": i, "seconds": s} when it has returned (a job
without it died, or the launch with it). Exit status 0 when every job's check passed on every rank.
"""
from __future__ import annotations

import importlib
import json
import sys
import time

from autoshard.testing import launch
from autoshard.world import current


def main() -> None:
    with open(sys.argv[1]) as f:
        jobs = json.load(f)
    launch.start_shared()
    for i, (module, argv) in enumerate(jobs):
        if current().rank() == 0:
            print(json.dumps({"job": i}), flush=True)
        name, _, entry = module.partition(":")
        sys.argv = [name, *argv]
        start = time.perf_counter()
        getattr(importlib.import_module(name), entry or "main")()
        if current().rank() == 0:
            print(json.dumps({"done": i, "seconds": round(time.perf_counter() - start, 1)}), flush=True)
    launch.leave(0 if launch.shared_ok() else 1)


if __name__ == "__main__":
    main()
