"""Peak memory and step time read off each rank's graphs (planning/graph_memory.py, graph_time.py)
against those measured in real gloo runs, over three model families.

    python benchmarks/graph_memory_sweep.py [--append] [--configs 0 3]

Each configuration runs benchmarks/sweep_worker.py under torchrun: every rank predicts its own peak
from its graphs before anything runs, then trains (AdamW, or the distributed optimizer), measures
its peak with autoshard.testing.memory.PeakBytes (parameters, buffers, gradient buffers and
optimizer state live before the step; every tensor the step makes) and the median of 3 steps.
Every rank's memory is compared; the step time (the slowest rank's) against `graph_time.step_time`
of the same program compiled here on the meta device, on a `cpu` profile measured for each family's
shapes (autoshard.cpu_profile.measure_cpu, stored and read back).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.sweep_common import append_results, rank_correlation, run_worker, sweep_options  # noqa: E402
from benchmarks.sweep_worker import MICRO, parser, split_of  # noqa: E402
from benchmarks.sweep_models import SWEEP_MODELS  # noqa: E402

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


def profile_of(model: str, cache: bool = True):
    """The `cpu` profile at the family's shapes (stored and read back unless `cache` is False)."""
    from autoshard.cpu_profile import measure_cpu
    m = SWEEP_MODELS[model].model()
    cfg = m.config
    hidden = getattr(cfg, "hidden_size", None) or cfg.n_embd
    heads = getattr(cfg, "num_attention_heads", None) or cfg.n_head
    return measure_cpu(hidden=hidden, heads=heads, seq=SWEEP_MODELS[model].seq, microbatch=MICRO, cache=cache)


def graph_seconds(model: str, argv: list[str], hw) -> float:
    """The step time read off the configuration's program, compiled from the model on the meta device."""
    import torch

    from autoshard import autoshard
    from autoshard.planning.graph_time import step_time
    spec, args = SWEEP_MODELS[model], parser().parse_args(argv)
    with torch.device("meta"):
        meta = spec.build().train()
    ids = torch.zeros(MICRO, spec.seq, dtype=torch.long)
    prog = autoshard(meta, **split_of(args), example_kwargs={spec.tokens: ids, spec.labels: ids})
    return step_time(prog, hw, distributed_optimizer=args.distributed_optimizer).seconds


def main() -> None:
    args, configs = sweep_options(__doc__.splitlines()[0], CONFIGS)
    lines = ["| model | configuration | rank (pp, tp, dp) | measured MiB | graph MiB | error | step s | graph s | error |",
             "|---|---|---|---|---|---|---|---|---|"]
    worst = worst_time = 0.0
    profiles, times = {}, []
    load = os.getloadavg()[0]
    for model, flags in configs:
        if model not in profiles:
            profiles[model] = profile_of(model)
        argv = ["--model", model, *flags.split()]
        ranks = run_worker(argv, world_of(argv))
        step = max(r["step_s"] for r in ranks)
        want = graph_seconds(model, flags.split(), profiles[model])
        worst_time = max(worst_time, abs(want - step) / step)
        times.append((want, step))
        for r in sorted(ranks, key=lambda r: r["rank"]):
            err = (r["graph_bytes"] - r["peak_bytes"]) / r["peak_bytes"]
            worst = max(worst, abs(err))
            lines.append(f"| {model} | `{flags}` | {r['rank']} ({r['pp_rank']}, {r['tp_rank']}, {r['dp_rank']}) | "
                         f"{r['peak_bytes'] / 2**20:.2f} | {r['graph_bytes'] / 2**20:.2f} | {100 * err:+.2f}% | "
                         f"{step:.3f} | {want:.3f} | {100 * (want - step) / step:+.1f}% |")
            print(lines[-1], flush=True)
    lines += ["", f"worst memory error {100 * worst:.2f}% over {len(configs)} configurations, every rank; worst "
              f"step-time error {100 * worst_time:.1f}%, rank correlation "
              f"{rank_correlation([t[0] for t in times], [t[1] for t in times]):.2f}; load average {load:.1f} "
              f"at the start, {os.getloadavg()[0]:.1f} at the end"]
    print(lines[-1])
    if args.append:
        append_results("Memory and step time read off the graphs vs measured",
                       "python benchmarks/graph_memory_sweep.py --append", lines)


if __name__ == "__main__":
    main()
