"""Does the planner pick the fastest split of a fixed job? Its candidates, measured on gloo.

    python benchmarks/planner_choice.py [--append] [--gpus 2] [--global-batch 8] [--top 8]

The job: the sweep's GPT (benchmarks/sweep_models.py) on `--gpus` CPU processes, `--global-batch`
sequences a step, on a `cpu` profile measured for its shapes. `autoshard.plan` lists the splits that
fit, fastest first by its table; the first `--top` are run with benchmarks/sweep_worker.py (the
median of 3 steps) and each is also predicted from its own graphs (planning/graph_time.py).
`autoshard(model, world_size=...)` keeps, of the table's first three, the fastest by its graphs
(planning/graph_fit.py): the report says whether that pick is the fastest measured, and the rank
correlation of each prediction with the measured times.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from autoshard import autoshard, plan  # noqa: E402
from autoshard.cpu_profile import measure_cpu  # noqa: E402
from autoshard.planning.graph_time import step_time  # noqa: E402
from benchmarks.sweep_common import append_results, rank_correlation, run_worker  # noqa: E402
from benchmarks.sweep_models import GPT_SHAPE, SWEEP_MODELS  # noqa: E402


def _meta_gpt():
    with torch.device("meta"):
        return SWEEP_MODELS["gpt"].build().train()


def _worker_args(e) -> list[str]:
    return ["--tp", str(e.tp), "--pp", str(e.pp), "--dp", str(e.dp), "--virtual-pipeline", str(e.virtual),
            "--microbatches", str(e.microbatches), "--micro", str(e.microbatch), "--recompute", e.recompute,
            *(["--schedule", e.schedule] if e.pp > 1 else []), *(["--sp"] if e.sequence_parallel else [])]


def _graph_seconds(e, hw) -> float:
    ids = torch.zeros(e.microbatch, GPT_SHAPE["block_size"], dtype=torch.long)
    prog = autoshard(_meta_gpt(), tp=e.tp, pp=e.pp, dp=e.dp, virtual=e.virtual, microbatches=e.microbatches,
                     recompute=e.recompute, schedule=e.schedule if e.pp > 1 else None, example_inputs=(ids, ids))
    return step_time(prog, hw).seconds


def main() -> None:
    import argparse
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--append", action="store_true", help="record the table in benchmarks/RESULTS.md")
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--top", type=int, default=8)
    args = ap.parse_args()
    seq = GPT_SHAPE["block_size"]
    hw = measure_cpu(hidden=GPT_SHAPE["n_embd"], heads=GPT_SHAPE["n_head"], seq=seq, microbatch=2)
    load = os.getloadavg()[0]
    candidates = plan(_meta_gpt(), gpus=args.gpus, global_batch=args.global_batch, hardware=hw, seq=seq)[:args.top]
    ids = torch.zeros(2, seq, dtype=torch.long)
    picked = autoshard(_meta_gpt(), world_size=args.gpus, global_batch=args.global_batch, hardware=hw,
                       example_inputs=(ids, ids)).planned
    rows = []
    for e in candidates:
        step = max(r["step_s"] for r in run_worker(_worker_args(e), args.gpus))
        rows.append((e, step, _graph_seconds(e, hw)))
        print(f"{e.tp} {e.pp} {e.dp} v={e.virtual} b={e.microbatch} m={e.microbatches} {e.recompute} {e.schedule}: "
              f"measured {step:.3f} s, table {e.seconds_per_iteration:.3f}, graphs {rows[-1][2]:.3f}", flush=True)
    fastest = min(rows, key=lambda r: r[1])[0]
    lines = ["| table rank | tp | pp | dp | v | microbatch | microbatches | recompute | schedule | measured s | table s | "
             "graph s | picked |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for i, (e, step, graph) in enumerate(rows, 1):
        lines.append(f"| {i} | {e.tp} | {e.pp} | {e.dp} | {e.virtual} | {e.microbatch} | {e.microbatches} | "
                     f"{e.recompute} | {e.schedule if e.pp > 1 else '-'} | {step:.3f} | {e.seconds_per_iteration:.3f} | "
                     f"{graph:.3f} | {'yes' if e == picked else ''} |")
    measured = [r[1] for r in rows]
    lines += ["", f"autoshard(world_size={args.gpus}) picked the table's #{candidates.index(picked) + 1}; the fastest "
              f"measured is the table's #{candidates.index(fastest) + 1} "
              f"({'the same' if picked == fastest else 'not the same'}); rank correlation with the measured times: "
              f"table {rank_correlation([r[0].seconds_per_iteration for r in rows], measured):.2f}, graphs "
              f"{rank_correlation([r[2] for r in rows], measured):.2f}; load average {load:.1f} at the start, "
              f"{os.getloadavg()[0]:.1f} at the end"]
    print("\n".join(lines))
    if args.append:
        append_results("The planner's pick of a fixed job vs its candidates measured",
                       f"python benchmarks/planner_choice.py --gpus {args.gpus} --global-batch {args.global_batch} "
                       f"--top {args.top} --append", lines)


if __name__ == "__main__":
    main()
