"""The planner's memory and step-time predictions against our own CPU gloo runs.

    python benchmarks/planner_sweep.py [--append]

First measures the `cpu` profile (autoshard.cpu_profile.measure_cpu) for the sweep's GPT
(hidden 256, 8 heads, 4 layers, vocabulary 512, sequence 128, 2 sequences per microbatch, dropout
0.1), then runs each configuration with torchrun (benchmarks/sweep_worker.py: AdamW, denormals
flushed) and compares, per rank, the measured peak bytes (parameters, gradients, optimizer state
and activations; autoshard.testing.memory.PeakBytes) with `memory_model.rank_memory` (the GPT
table) and with the rank's own graphs (planning/graph_memory.py), and the
median step time with `costmodel.estimate(..., hardware=profile)`.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from autoshard.cpu_profile import measure_cpu  # noqa: E402
from autoshard.planning.costmodel import estimate  # noqa: E402
from autoshard.planning.memory_model import RankMemory, gpt_rank_memory  # noqa: E402
from benchmarks.sweep_common import append_results, rank_correlation, run_worker, sweep_options  # noqa: E402
from benchmarks.sweep_worker import MICRO, SHAPE  # noqa: E402

# (tp, pp, dp, virtual, microbatches, recompute, sequence parallel[, schedule])
CONFIGS = [
    (1, 1, 1, 1, 1, "none", False), (1, 1, 1, 1, 2, "full", False), (2, 1, 1, 1, 1, "none", False),
    (2, 1, 1, 1, 2, "selective", False), (2, 1, 1, 1, 1, "full", True), (1, 2, 1, 1, 4, "none", False),
    (1, 2, 1, 1, 4, "selective", False), (1, 2, 1, 2, 4, "full", False), (1, 1, 2, 1, 2, "none", False),
    (2, 2, 1, 1, 4, "none", False),
    (1, 2, 1, 1, 4, "none", False, "zb-h1"), (1, 2, 1, 2, 4, "none", False, "zbv"),
    (1, 2, 1, 2, 4, "none", False, "v-half"),
]


def worker_args(config) -> list[str]:
    """benchmarks/sweep_worker.py's arguments for one configuration (run on tp * pp * dp processes)."""
    tp, pp, dp, v, m, rc, sp, *schedule = config
    return (["--tp", str(tp), "--pp", str(pp), "--dp", str(dp), "--virtual-pipeline", str(v), "--microbatches", str(m),
             "--recompute", rc] + (["--sp"] if sp else []) + (["--schedule", schedule[0]] if schedule else []))


def run(config) -> list[dict]:
    tp, pp, dp = config[:3]
    return run_worker(worker_args(config), tp * pp * dp)


def predicted_memory(config, pp_rank: int, hw) -> RankMemory:
    tp, pp, dp, v, m, rc, sp, *schedule = config
    return gpt_rank_memory(hw, hidden=SHAPE["n_embd"], layers=SHAPE["n_layer"], heads=SHAPE["n_head"],
                           vocab=SHAPE["vocab_size"], seq=SHAPE["block_size"], tp=tp, pp=pp, pp_rank=pp_rank,
                           microbatch=MICRO, microbatches=m, virtual=v, recompute=rc, sequence_parallel=sp,
                           resid_dropouts=1,      # nanoGPT: dropout after the MLP only
                           schedule=schedule[0] if schedule else None)


def predicted_seconds(config, hw) -> float:
    tp, pp, dp, v, m, rc, sp, *schedule = config
    return estimate(hidden=SHAPE["n_embd"], layers=SHAPE["n_layer"], heads=SHAPE["n_head"], vocab=SHAPE["vocab_size"],
                    seq=SHAPE["block_size"], tp=tp, pp=pp, dp=dp, global_batch=dp * m * MICRO, microbatch=MICRO,
                    virtual=v, hardware=hw, recompute=rc, sequence_parallel=sp,
                    gather_logits=True,            # the GPT returns its logits, gathered
                    schedules=tuple(schedule) or None).seconds_per_iteration


def graph_seconds(config, hw) -> float:
    """The step time read off the configuration's own program (planning/graph_time.py), compiled
    from the sweep's GPT on the meta device."""
    import torch

    from autoshard import autoshard
    from autoshard.planning.graph_time import step_time
    from benchmarks.sweep_models import SWEEP_MODELS
    tp, pp, dp, v, m, rc, sp, *schedule = config
    with torch.device("meta"):
        model = SWEEP_MODELS["gpt"].build().train()
    ids = torch.zeros(MICRO, SHAPE["block_size"], dtype=torch.long)
    prog = autoshard(model, tp=tp, pp=pp, dp=dp, virtual=v, microbatches=m, recompute=rc, sequence_parallel=sp,
                     schedule=schedule[0] if schedule else None, example_inputs=(ids, ids))
    return step_time(prog, hw).seconds


def main() -> None:
    args, configs = sweep_options(__doc__.splitlines()[0], CONFIGS)
    hw = measure_cpu(hidden=SHAPE["n_embd"], heads=SHAPE["n_head"], seq=SHAPE["block_size"], microbatch=MICRO)
    lines = [f"profile: GEMM {hw.peak_tflops * 1e3:.1f} GFLOP/s, element-wise {hw.hbm_gb_s:.2f} GB/s, "
             f"layer dispatch {hw.layer_overhead_s * 1e3:.2f} ms, step fixed {hw.step_overhead_s * 1e3:.2f} ms, "
             f"AdamW {hw.optimizer_s_per_param * 1e9:.2f} ns/param, gloo {hw.latency_us:.0f} us + "
             f"{hw.network_gb_s:.2f} GB/s, {hw.cores} cores; per aten op {hw.op_overhead_s * 1e6:.2f} us, other ops' "
             f"bytes {hw.op_bytes_gb_s:.2f} GB/s", "",
             "| tp | pp | dp | v | m | recompute | sp | schedule | rank | peak MiB | table MiB | error | graph MiB | error | "
             "step s | model s | error | graph s | error |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    worst_mem = worst_graph = worst_time = worst_graph_time = 0.0
    pairs = []
    for config in configs:
        ranks = run(config)
        want_s = predicted_seconds(config, hw)
        step = max(r["step_s"] for r in ranks)
        t_err = (want_s - step) / step
        worst_time = max(worst_time, abs(t_err))
        graph_s = graph_seconds(config, hw)
        gt_err = (graph_s - step) / step
        worst_graph_time = max(worst_graph_time, abs(gt_err))
        pairs.append((want_s, graph_s, step))
        for r in sorted(ranks, key=lambda r: r["rank"]):
            if r["tp_rank"] or r["dp_rank"]:
                continue         # tensor- and data-parallel peers hold what their pipeline rank holds
            want = predicted_memory(config, r["pp_rank"], hw).peak
            err = (want - r["peak_bytes"]) / r["peak_bytes"]
            worst_mem = max(worst_mem, abs(err))
            g_err = (r["graph_bytes"] - r["peak_bytes"]) / r["peak_bytes"]
            worst_graph = max(worst_graph, abs(g_err))
            tp, pp, dp, v, m, rc, sp, *schedule = config
            lines.append(f"| {tp} | {pp} | {dp} | {v} | {m} | {rc} | {sp} | {(schedule or ['-'])[0]} | {r['rank']} | "
                         f"{r['peak_bytes'] / 2**20:.1f} | {want / 2**20:.1f} | {100 * err:+.1f}% | "
                         f"{r['graph_bytes'] / 2**20:.1f} | {100 * g_err:+.2f}% | {step:.3f} | "
                         f"{want_s:.3f} | {100 * t_err:+.1f}% | {graph_s:.3f} | {100 * gt_err:+.1f}% |")
        print(lines[-1], flush=True)
    lines += ["", f"worst memory error {100 * worst_mem:.1f}% (GPT table), {100 * worst_graph:.2f}% (read off the "
              f"graphs), worst step-time error {100 * worst_time:.1f}% "
              f"over {len(configs)} configurations; read off the graphs, worst step-time error "
              f"{100 * worst_graph_time:.1f}%; rank correlation of predicted and measured step times: "
              f"{rank_correlation([p[0] for p in pairs], [p[2] for p in pairs]):.2f} (table), "
              f"{rank_correlation([p[1] for p in pairs], [p[2] for p in pairs]):.2f} (graphs); load average "
              f"{os.getloadavg()[0]:.1f} at the end"]
    print("\n".join(lines))
    if args.append:
        append_results("Planner predictions vs our CPU gloo runs", "python benchmarks/planner_sweep.py --append", lines)


if __name__ == "__main__":
    main()
