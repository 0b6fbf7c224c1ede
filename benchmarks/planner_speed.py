"""How long the planner's search takes (`autoshard.plan` on a shape: formulas and the schedule
simulator, no model built) and the simulator alone, for one checkout or several side by side.

    python benchmarks/planner_speed.py [CHECKOUT ...] [--rounds 3] [--quick] [--append]

Each run is a fresh process importing autoshard from one checkout (PYTHONPATH first; default: this
one), one job per process; with several checkouts the runs alternate, so a shared machine's drift
hits each side alike. Reported: the median seconds of each job per checkout and, from the second
checkout on, the median of per-round ratios to the first. A simulator job's seconds are the fastest
of 5 runs of `check` in its process; each job's result (the plans found, the timeline's makespan)
must be the same on every checkout, or the script stops.
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from checkout_ab import run_in_checkout
from results import report
from tabulate import tabulate

ROOT = Path(__file__).resolve().parents[1]

# name -> plan() arguments: shapes the planner is run on in practice (a 64-GPU dense job, the same
# with experts, a 512-GPU job)
JOBS = {
    "gpt3-175b, 64 gpus": {"shape": dict(hidden=12288, layers=96, heads=96, vocab=51200, seq=2048),
                           "gpus": 64, "global_batch": 1536},
    "mixtral-8x7b (moe), 64 gpus": {"shape": dict(hidden=4096, layers=32, heads=32, vocab=32000, seq=4096),
                                    "gpus": 64, "global_batch": 256, "moe": (8, 2, 14336)},
    "gpt3-175b, 512 gpus": {"shape": dict(hidden=12288, layers=96, heads=96, vocab=51200, seq=2048),
                            "gpus": 512, "global_batch": 1536},
}
# the schedule simulator alone (runtime/schedules.check, most of a large search): one schedule of
# 1,000-12,000 actions, the fastest of 5 runs
JOBS.update({f"simulate {name}, pp {pp}, m {m}": {"schedule": [name, pp, v, m]}
             for name, pp, v, m in [("1f1b", 32, 1, 128), ("zb-h1", 32, 1, 128), ("interleaved", 16, 2, 64),
                                    ("zbv", 16, 2, 64), ("v-half", 8, 2, 32)]})
QUICK = {"gpt2-xl, 8 gpus": {"shape": dict(hidden=1600, layers=48, heads=25, vocab=50257, seq=1024),
                            "gpus": 8, "global_batch": 64}}

_CHILD = """
import json, sys, time
import autoshard
from autoshard import plan
from autoshard.planning.moe_cost import MoEShape
from autoshard.planning.planner import ModelShape
from autoshard.runtime.schedules import check, make_schedule, schedule_spec
job = json.loads(sys.argv[1])
if "schedule" in job:
    name, pp, v, m = job["schedule"]
    steps, runs = make_schedule(name, pp, v, m), []
    for _ in range(5):
        t0 = time.perf_counter()
        timeline = check(steps, v, m, backward_cost=1.1, weight_cost=0.9, placement=schedule_spec(name).placement)
        runs.append(time.perf_counter() - t0)
    seconds, result = min(runs), timeline.makespan
else:
    moe = MoEShape(*job["moe"]) if "moe" in job else None
    t0 = time.perf_counter()
    found = plan(ModelShape(**job["shape"]), gpus=job["gpus"], global_batch=job["global_batch"], moe=moe)
    seconds, result = time.perf_counter() - t0, len(found)
print(json.dumps({"file": autoshard.__file__, "seconds": seconds, "result": result}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkouts", nargs="*", type=Path, default=[ROOT])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="a small job, one round (a smoke test)")
    ap.add_argument("--append", action="store_true", help="append the table to benchmarks/RESULTS.md")
    args = ap.parse_args()
    checkouts = [c.resolve() for c in args.checkouts]
    jobs = QUICK if args.quick else JOBS
    rounds = 1 if args.quick else args.rounds
    rows = []
    for name, job in jobs.items():
        runs = []                                            # round -> checkout -> result
        for _ in range(rounds):
            runs.append([run_in_checkout(c, _CHILD, json.dumps(job), hint=", not from the checkout") for c in checkouts])
        results = {r["result"] for rnd in runs for r in rnd}
        if len(results) != 1:
            raise SystemExit(f"{name}: the checkouts disagree (plans found, or the timeline's makespan): {sorted(results)}")
        row = [name, results.pop()] + [f"{statistics.median(rnd[i]['seconds'] for rnd in runs):.4f}"
                                     for i in range(len(checkouts))]
        row += [f"{statistics.median(rnd[i]['seconds'] / rnd[0]['seconds'] for rnd in runs):.3f}"
                for i in range(1, len(checkouts))]
        rows.append(row)
    headers = ["job", "plans / makespan"] + [f"s, {c.name}" for c in checkouts] + [f"/ {checkouts[0].name}, {c.name}"
                                                                         for c in checkouts[1:]]
    report(tabulate(rows, headers=headers, tablefmt="github"),
           f"medians of {rounds} alternating rounds, one fresh process per run",
           append=args.append, title="The planner's search time",
           command="python benchmarks/planner_speed.py " + " ".join(map(str, args.checkouts))
                   + f" --rounds {rounds}", what="seconds of plan() on a shape; ratio to the first checkout")


if __name__ == "__main__":
    main()
