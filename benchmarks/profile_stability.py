"""The `cpu` profile measured twice: how far the step times read off the graphs move between two
measurements of the same machine (issue: within 10%).

    python benchmarks/profile_stability.py [--append] [--configs 0 3]

For each model family of benchmarks/graph_memory_sweep.py, `measure_cpu` at that family's shapes
twice (nothing read from or stored in the cache), then `graph_seconds` of each of the family's
configurations on either profile: their difference, and the measured values that moved most.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.graph_memory_sweep import CONFIGS, graph_seconds, profile_of  # noqa: E402
from benchmarks.sweep_common import append_results, sweep_options  # noqa: E402

def _values(hw) -> str:
    startup = ", ".join(f"{kind} {us:.0f}" for kind, us in hw.startup_us)
    return (f"GEMM {hw.peak_tflops * 1e3:.1f} GFLOP/s, attention {hw.attention_tflops * 1e3:.1f} GFLOP/s, per op {hw.op_overhead_s * 1e6:.2f} us, op bytes "
            f"{hw.op_bytes_gb_s:.2f} GB/s, gloo {hw.nvlink_gb_s:.2f} GB/s, start-up us: {startup}")


def main() -> None:
    args, configs = sweep_options(__doc__.splitlines()[0], CONFIGS)
    load = os.getloadavg()[0]
    families = sorted({model for model, _ in configs}, key=[m for m, _ in CONFIGS].index)
    lines = ["| model | configuration | graph s, first profile | graph s, second | difference |",
             "|---|---|---|---|---|"]
    notes, worst = [], 0.0
    for model in families:
        first, second = profile_of(model, cache=False), profile_of(model, cache=False)
        notes += [f"- {model}, first: {_values(first)}", f"- {model}, second: {_values(second)}"]
        for name, flags in configs:
            if name != model:
                continue
            a, b = graph_seconds(model, flags.split(), first), graph_seconds(model, flags.split(), second)
            worst = max(worst, abs(b - a) / a)
            lines.append(f"| {model} | `{flags}` | {a:.3f} | {b:.3f} | {100 * (b - a) / a:+.1f}% |")
            print(lines[-1], flush=True)
    lines += ["", *notes, "", f"worst difference {100 * worst:.1f}% over {len(configs)} configurations; load average "
              f"{load:.1f} at the start, {os.getloadavg()[0]:.1f} at the end"]
    print("\n".join(lines[-len(notes) - 2:]))
    if args.append:
        append_results("The cpu profile measured twice: step times read off the graphs",
                       "python benchmarks/profile_stability.py --append", lines)


if __name__ == "__main__":
    main()
