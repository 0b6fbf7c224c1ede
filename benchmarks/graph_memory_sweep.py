"""Peak memory read off each rank's graphs (planning/graph_memory.py) against the peak measured in
real gloo runs, over three model families, and beside it what the GPT table predicts.

    python benchmarks/graph_memory_sweep.py [--append] [--configs 0 3]

Each configuration runs benchmarks/sweep_worker.py under torchrun: every rank predicts its own peak
from its graphs before anything runs, then trains (AdamW, or the distributed optimizer) and measures
its peak with autoshard.testing.memory.PeakBytes (parameters, buffers, gradient buffers and
optimizer state live before the step; every tensor the step makes). Every rank is compared.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.planner_sweep import run_worker  # noqa: E402

# (model, sweep_worker arguments): tp, pp with v = 2, dp with the distributed optimizer, sp, each
# recompute mode, a zero-bubble schedule and expert parallelism
CONFIGS = [
    ("gpt2", "--tp 2 --microbatches 2"),
    ("gpt2", "--tp 2 --sp --recompute selective --microbatches 2"),
    ("gpt2", "--pp 2 --virtual-pipeline 2 --microbatches 4 --recompute full"),
    ("gpt2", "--dp 2 --distributed-optimizer --microbatches 2"),
    ("llama", "--tp 2 --recompute selective --microbatches 2"),
    ("llama", "--pp 2 --virtual-pipeline 2 --microbatches 4"),
    ("llama", "--dp 2 --distributed-optimizer --microbatches 2"),
    ("llama", "--tp 2 --pp 2 --sp --recompute full --microbatches 4"),
    ("llama", "--pp 2 --microbatches 4 --schedule zb-h1"),
    ("mixtral", "--tp 2 --microbatches 2"),
    ("mixtral", "--pp 2 --microbatches 4 --recompute selective"),
    ("mixtral", "--dp 2 --ep 2 --microbatches 2"),
    ("mixtral", "--dp 2 --ep 2 --distributed-optimizer --microbatches 2"),
]


def world_of(args: list[str]) -> int:
    sizes = {name: int(args[args.index(f"--{name}") + 1]) if f"--{name}" in args else 1 for name in ("tp", "pp", "dp")}
    return sizes["tp"] * sizes["pp"] * sizes["dp"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--append", action="store_true", help="record the table in benchmarks/RESULTS.md")
    ap.add_argument("--configs", type=int, nargs="+", default=None, help="indices into CONFIGS (default: all)")
    args = ap.parse_args()
    configs = [CONFIGS[i] for i in args.configs] if args.configs else CONFIGS
    lines = ["| model | configuration | rank (pp, tp, dp) | measured MiB | graph MiB | error |", "|---|---|---|---|---|---|"]
    worst = 0.0
    for model, flags in configs:
        argv = ["--model", model, *flags.split(), "--steps", "1"]
        for r in sorted(run_worker(argv, world_of(argv)), key=lambda r: r["rank"]):
            err = (r["graph_bytes"] - r["peak_bytes"]) / r["peak_bytes"]
            worst = max(worst, abs(err))
            lines.append(f"| {model} | `{flags}` | {r['rank']} ({r['pp_rank']}, {r['tp_rank']}, {r['dp_rank']}) | "
                         f"{r['peak_bytes'] / 2**20:.2f} | {r['graph_bytes'] / 2**20:.2f} | {100 * err:+.2f}% |")
            print(lines[-1], flush=True)
    lines += ["", f"worst error {100 * worst:.2f}% over {len(configs)} configurations, every rank"]
    print(lines[-1])
    if args.append:
        with open(ROOT / "benchmarks" / "RESULTS.md", "a") as fh:
            fh.write(f"\n### Peak memory read off the graphs vs measured, {datetime.date.today()}, {platform.node()} "
                     f"({platform.machine()}, {os.cpu_count()} cores)\n\n`python benchmarks/graph_memory_sweep.py "
                     f"--append`\n\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
