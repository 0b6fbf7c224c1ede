"""bf16 and fp16 training with fp32 main weights against fp32, on CPU gloo: the full matrix of
tests/harness/mixed_precision_check.py (GPT-2 and Llama, bf16 and fp16, 50 AdamW steps) at
(tp, pp, dp) = (2,1,2), (1,2,2), (2,2,2). The test suite runs a rotation of it.

    .venv/bin/python benchmarks/mixed_precision.py [--steps 50] [--append]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
MESHES = [(2, 1, 2), (1, 2, 2), (2, 2, 2)]


def run(tp: int, pp: int, dp: int, steps: int) -> list[dict]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={tp * pp * dp}",
           "-m", "tests.harness.mixed_precision_check", "--tp", str(tp), "--pp", str(pp), "--dp", str(dp),
           "--steps", str(steps)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=HERE.parent, env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 and not lines:
        raise SystemExit(proc.stderr[-3000:])
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--append", action="store_true")
    args = ap.parse_args()
    rows = ["| (tp, pp, dp) | model | precision | loss step 1 -> last | fp32 last | max loss diff vs fp32 (rel) "
            "| step-1 main weights vs same-casts reference (norm rel) | tied weight | fp16: inf skipped on all ranks, scale halved | ok |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    ok = True
    for tp, pp, dp in MESHES:
        for r in run(tp, pp, dp, args.steps):
            inf = "yes" if r.get("inf_step_skipped") and r.get("scale_halved") and not r.get("inf_step_changed_params") else (
                "-" if r["precision"] == "bf16" else "NO")
            ok &= r["all_ranks_ok"]
            rows.append(f"| ({tp}, {pp}, {dp}) | {r['model']} | {r['precision']} | {r['first_losses'][0]:.3f} -> "
                        f"{r['last_loss']:.3f} | {r['fp32_last_loss']:.3f} | {r['loss_rel_vs_fp32']:.1e} | "
                        f"{r['main_rel_step1']:.1e} | {r['tied_main_rel_step1']:.1e} | {inf} | {r['all_ranks_ok']} |")
    table = "\n".join(rows)
    summary = (f"{args.steps} AdamW steps (lr 3e-3, clip 1.0) on arithmetic token sequences, 2 layers, hidden 64, "
               "2 microbatches; the reference: the same program simulated in one process with each microbatch's "
               "half-precision gradient added in fp32 (a weight tied across stages is listed apart: its stages' "
               "gradients are summed in fp32 here, in half precision by autograd in one process).")
    print(table)
    print(summary)
    if args.append:
        from results import append_result
        append_result("Mixed precision (fp32 main weights) vs fp32", f"benchmarks/mixed_precision.py --steps {args.steps}",
                      "CPU gloo, OMP_NUM_THREADS=1", f"{table}\n\n{summary}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    sys.exit(main())
