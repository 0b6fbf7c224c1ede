"""The cost model against the papers' published runs, and the planner against the papers' choices.

    python benchmarks/costmodel_validate.py [--append]

Prints (and with --append records in RESULTS.md):
1. PTD-P Table 1 (A100 80GB): predicted vs published TFLOP/s per GPU, error, the model's chosen
   microbatch and interleaving, its time breakdown; mean absolute percentage error and worst row;
2. the same error at other values of the one chosen constant, the A100's matmul efficiency;
3. per Table 1 row, where the planner ranks the paper's (tp, pp), and its own first choice;
4. interleaved (v=2) over plain 1F1B for GPT-3 175B on 96 GPUs (t=8, p=12) as batch grows;
5. the 2019 paper's weak scaling on V100s (model parallel at batch 8; with 64-way data parallel at
   batch 512, gradient all-reduce overlapped as torch DDP does).
The CSVs in benchmarks/reference/ are the papers' tables, copied from ../shared/reference.
"""
from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from autoshard.planning.costmodel import Estimate, estimate  # noqa: E402
from autoshard.planning.hardware import get_hardware  # noqa: E402
from autoshard.planning.planner import ModelShape, plan  # noqa: E402

REFERENCE = Path(__file__).with_name("reference")
VOCAB, SEQ = 51200, 2048


def read_csv(name: str) -> list[dict[str, str]]:
    with (REFERENCE / name).open() as f:
        return list(csv.DictReader(line for line in f if not line.startswith("#")))


def table1() -> list[dict[str, int | float]]:
    ints = ("heads", "hidden", "layers", "tp", "pp", "gpus", "global_batch")
    return [{**{k: int(r[k]) for k in ints}, "params_billion": float(r["params_billion"]),
             "tflops_per_gpu": float(r["tflops_per_gpu"])} for r in read_csv("megatron_ptdp_table1.csv")]


def predict_row(row: dict, hardware="a100-80gb", **kw) -> Estimate:
    return estimate(hidden=row["hidden"], layers=row["layers"], heads=row["heads"], vocab=VOCAB, seq=SEQ,
                    tp=row["tp"], pp=row["pp"], dp=row["gpus"] // (row["tp"] * row["pp"]),
                    global_batch=row["global_batch"], hardware=hardware, **kw)


def table1_errors(hardware="a100-80gb") -> list[tuple[dict, Estimate, float]]:
    """(row, estimate, signed relative error) per Table 1 row."""
    out = []
    for row in table1():
        e = predict_row(row, hardware)
        out.append((row, e, e.tflops_per_gpu / row["tflops_per_gpu"] - 1))
    return out


def planner_ranks() -> list[tuple[dict, int | None, Estimate, Estimate | None]]:
    """(row, 1-based rank of the paper's (tp, pp), planner's first choice, paper's estimate) per row;
    full recompute and no context parallelism, as the paper's runs."""
    out = []
    for row in table1():
        plans = plan(ModelShape(row["hidden"], row["layers"], row["heads"], VOCAB, SEQ), gpus=row["gpus"],
                     global_batch=row["global_batch"], recompute="full", schedules=("1f1b", "interleaved"))
        order = [(e.tp, e.pp) for e in plans]
        where = order.index((row["tp"], row["pp"])) if (row["tp"], row["pp"]) in order else None
        out.append((row, None if where is None else where + 1, plans[0], None if where is None else plans[where]))
    return out


def interleaving_gain(batches=(12, 24, 36, 48, 60, 96, 192, 384, 768)) -> list[tuple[int, float, float, float]]:
    """(batch, 1F1B TFLOP/s, interleaved v=2 TFLOP/s, gain) for GPT-3 175B, t=8, p=12, microbatch 1."""
    out = []
    for batch in batches:
        kw = dict(hidden=12288, layers=96, heads=96, vocab=VOCAB, seq=SEQ, tp=8, pp=12, dp=1,
                  global_batch=batch, microbatch=1)
        plain, inter = estimate(virtual=1, **kw).tflops_per_gpu, estimate(virtual=2, **kw).tflops_per_gpu
        out.append((batch, plain, inter, inter / plain - 1))
    return out


def weak_scaling_2019() -> list[tuple[float, int, float, float, int]]:
    """(params_billion, gpus, TFLOP/s per GPU, efficiency vs the 1-GPU 1.2B run, published %) rows."""
    published = {(8, 8): 77, (8, 512): 74}
    out, base = [], None
    for r in read_csv("megatron_2019_table1.csv"):
        h, a, layers, t = int(r["hidden"]), int(r["heads"]), int(r["layers"]), int(r["model_parallel_gpus"])
        for gpus, batch in ((t, 8), (int(r["model_and_data_parallel_gpus"]), 512)):
            e = estimate(hidden=h, layers=layers, heads=a, vocab=VOCAB, seq=1024, tp=t, pp=1, dp=gpus // t,
                         global_batch=batch, microbatch=8, hardware="v100-32gb", overlap_grad_reduce=True)
            base = base or e.tflops_per_gpu
            out.append((float(r["params_billion"]), gpus, e.tflops_per_gpu, e.tflops_per_gpu / base,
                        published.get((t, gpus))))
    return out


def _mape(errors: list[float]) -> tuple[float, float]:
    return 100 * sum(abs(x) for x in errors) / len(errors), 100 * max(abs(x) for x in errors)


def report() -> str:
    parts = []
    rows = table1_errors()
    mape, worst = _mape([err for _, _, err in rows])
    parts.append(tabulate(
        [(r["params_billion"], r["tp"], r["pp"], r["gpus"], r["global_batch"], e.microbatch, e.virtual,
          f"{e.tflops_per_gpu:.1f}", r["tflops_per_gpu"], f"{100 * err:+.1f}%",
          " ".join(f"{k} {100 * x / e.seconds_per_iteration:.0f}%" for k, x in e.breakdown.items() if x > 0))
         for r, e, err in rows],
        headers=("B params", "tp", "pp", "GPUs", "batch", "micro", "v", "predicted", "published", "error",
                 "time split"), tablefmt="github"))
    parts.append(f"Table 1: mean absolute percentage error {mape:.2f}%, worst row {worst:.2f}%.")
    sweep = []
    for eff in (0.6, 0.65, 0.70, 0.75, 0.79):
        m, w = _mape([err for _, _, err in table1_errors(get_hardware("a100-80gb", matmul_efficiency=eff))])
        sweep.append((eff, f"{m:.2f}%", f"{w:.2f}%"))
    parts.append(tabulate(sweep, headers=("A100 matmul efficiency", "MAPE", "worst row"), tablefmt="github"))
    ranks = planner_ranks()
    parts.append(tabulate(
        [(r["params_billion"], r["gpus"], (r["tp"], r["pp"]), rank, (best.tp, best.pp, best.microbatch, best.virtual),
          f"{best.tflops_per_gpu:.1f}", f"{paper.tflops_per_gpu:.1f}" if paper else "-")
         for r, rank, best, paper in ranks],
        headers=("B params", "GPUs", "paper (tp, pp)", "its rank", "planner (tp, pp, micro, v)",
                 "planner TFLOP/s", "paper's config TFLOP/s"), tablefmt="github"))
    parts.append(tabulate([(b, f"{p:.1f}", f"{i:.1f}", f"{100 * g:+.1f}%") for b, p, i, g in interleaving_gain()],
                          headers=("batch", "1F1B", "interleaved v=2", "gain"), tablefmt="github"))
    parts.append(tabulate([(p, g, f"{tf:.1f}", f"{100 * eff:.0f}%", f"{pub}%" if pub else "-")
                           for p, g, tf, eff, pub in weak_scaling_2019()],
                          headers=("B params", "GPUs", "TFLOP/s per GPU", "weak scaling", "published"),
                          tablefmt="github"))
    return "\n\n".join(parts)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--append", action="store_true", help="record the tables in benchmarks/RESULTS.md")
    args = ap.parse_args(argv)
    body = report()
    print(body)
    if args.append:
        from results import append_result
        append_result("Cost model vs published runs", "python benchmarks/costmodel_validate.py --append",
                      "no hardware run: predictions vs the papers' tables", body)


if __name__ == "__main__":
    main()
