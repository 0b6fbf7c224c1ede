"""What the sweeps share (planner_sweep.py, graph_memory_sweep.py): running sweep_worker.py under
torchrun, their command line, Spearman's rank correlation and recording a table in RESULTS.md."""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

__all__ = ["append_results", "rank_correlation", "run_worker", "sweep_options"]


def run_worker(args: list[str], world: int) -> list[dict]:
    """benchmarks/sweep_worker.py with `args` on `world` processes: one dict per rank."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
           "-m", "benchmarks.sweep_worker", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode:
        raise RuntimeError(f"{' '.join(args)} failed:\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}")
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def rank_correlation(a: list[float], b: list[float]) -> float:
    """Spearman's: the Pearson correlation of the ranks (no ties expected)."""
    if len(a) < 2:
        return float("nan")
    ra, rb = ([sorted(x).index(v) for v in x] for x in (a, b))
    n = len(a)
    mean = (n - 1) / 2
    cov = sum((x - mean) * (y - mean) for x, y in zip(ra, rb))
    var = sum((x - mean) ** 2 for x in ra)
    return cov / var


def sweep_options(description: str, configs: list) -> tuple[argparse.Namespace, list]:
    """The sweeps' command line (--append, --configs) and the configurations it selects."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--append", action="store_true", help="record the table in benchmarks/RESULTS.md")
    ap.add_argument("--configs", type=int, nargs="+", default=None, help="indices into CONFIGS (default: all)")
    args = ap.parse_args()
    return args, [configs[i] for i in args.configs] if args.configs else configs


def append_results(title: str, command: str, lines: list[str]) -> None:
    """A dated section in benchmarks/RESULTS.md: the title, machine, command and table."""
    with open(ROOT / "benchmarks" / "RESULTS.md", "a") as fh:
        fh.write(f"\n### {title}, {datetime.date.today()}, {platform.node()} ({platform.machine()}, "
                 f"{os.cpu_count()} cores)\n\n`{command}`\n\n" + "\n".join(lines) + "\n")
