"""A benchmark script that runs its own `--worker` under torchrun on one machine and reads back the
first JSON line its ranks print."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_workers(script: str, argv: list[str], *, nproc: int = 2, env: dict[str, str] | None = None) -> dict:
    """`script --worker ARGV` (less `--append`, which the launching side handles) on `nproc` gloo
    processes from the repository root; the first line starting with "{" of their output, parsed.
    Exits naming the script and the end of its error output when the workers fail."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", script,
           "--worker", *(a for a in argv if a != "--append")]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env={**os.environ, **(env or {})})
    if proc.returncode:
        sys.exit(f"{Path(script).stem}: the workers failed:\n{proc.stderr[-3000:]}")
    return json.loads(next(x for x in proc.stdout.splitlines() if x.startswith("{")))
