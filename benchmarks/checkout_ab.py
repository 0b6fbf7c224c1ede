"""Two checkouts of autoshard side by side: compile time and simulated step time, alternating runs.

    python benchmarks/checkout_ab.py OLD_DIR NEW_DIR [--rounds 3] [--append] [--quick]

For a change that must not change behaviour or speed (a refactor). Each run is a fresh process
importing autoshard from one checkout (PYTHONPATH first; a checkout from before the subsystem
layout needs `ln -s ../passes autoshard/passes` and the same for kernels so that it does not
import the installed passes). Per configuration: median compile seconds (`autoshard(...)`) and
median seconds of a simulated forward + backward after one warm-up call, with the ratio new / old.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

from results import report
from tabulate import tabulate

CONFIGS = [("gpt2", {"tp": 2}), ("gpt2", {"tp": 2, "pp": 2, "microbatches": 2}), ("llama", {"tp": 2})]

_CHILD = """
import json, sys, time, torch
import autoshard
from autoshard import autoshard as shard
from autoshard.testing.models import build_model
name, kw, layers = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
torch.manual_seed(0)
model = build_model(name, layers=layers)
ids = torch.randint(0, 128, (2, 32))
t0 = time.perf_counter(); prog = shard(model, **kw); t1 = time.perf_counter()
def step():
    prog.simulate(input_ids=ids).logits.float().pow(2).mean().backward()
step()
t2 = time.perf_counter()
for _ in range(3):
    step()
print(json.dumps({"file": autoshard.__file__, "compile_s": t1 - t0, "step_s": (time.perf_counter() - t2) / 3}))
"""


def run_in_checkout(checkout: str, child: str, *args: str, hint: str = "") -> dict:
    """Run the Python source `child` with `args` in a fresh process (one thread) that imports
    autoshard from `checkout` (PYTHONPATH first, the checkout as working folder); the JSON of its
    last printed line, which must name the autoshard it imported as "file" (a process that imported
    another autoshard stops the script, naming both, and `hint`)."""
    env = {**os.environ, "PYTHONPATH": str(checkout), "OMP_NUM_THREADS": "1"}
    # the import is checked first, so that a wrong checkout stops before the child's work
    guard = (f"import json, os, autoshard\nif not autoshard.__file__.startswith({os.path.abspath(checkout)!r}):\n"
             f"    print(json.dumps({{'file': autoshard.__file__}})); raise SystemExit\n")
    out = subprocess.run([sys.executable, "-c", guard + child, *args], env=env, capture_output=True,
                         text=True, check=True, cwd=checkout).stdout
    got = json.loads(out.strip().splitlines()[-1])
    if not got["file"].startswith(os.path.abspath(checkout)):
        raise SystemExit(f"{checkout}: imported autoshard from {got['file']}{hint}")
    return got


def _run(checkout: str, name: str, kw: dict, layers: int) -> dict:
    return run_in_checkout(checkout, _CHILD, name, json.dumps(kw), str(layers), hint="; see the module docstring")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="one configuration of 2 layers, one round (a smoke test)")
    ap.add_argument("--append", action="store_true", help="append the table to benchmarks/RESULTS.md")
    args = ap.parse_args()
    rows = []
    if args.quick:
        args.rounds = 1
    for name, kw in CONFIGS[:1] if args.quick else CONFIGS:
        runs: dict[str, list[dict]] = {"old": [], "new": []}
        for _ in range(args.rounds):             # alternate, so drift on a shared machine hits both
            for side in ("old", "new"):
                runs[side].append(_run(getattr(args, side), name, kw, 2 if args.quick else 4))
        med = {side: {k: statistics.median(r[k] for r in rs) for k in ("compile_s", "step_s")}
               for side, rs in runs.items()}
        rows.append([f"{name} {' '.join(f'{k}={v}' for k, v in kw.items())}",
                     f"{med['old']['compile_s']:.2f}", f"{med['new']['compile_s']:.2f}",
                     f"{med['new']['compile_s'] / med['old']['compile_s']:.2f}",
                     f"{1e3 * med['old']['step_s']:.1f}", f"{1e3 * med['new']['step_s']:.1f}",
                     f"{med['new']['step_s'] / med['old']['step_s']:.2f}"])
    headers = ["config", "compile old s", "compile new s", "ratio", "step old ms", "step new ms", "ratio"]
    report(tabulate(rows, headers=headers, tablefmt="github"),
           f"medians of {args.rounds} alternating runs per side; step = simulated forward + backward",
           append=args.append, title="Two checkouts side by side",
           command=f"python benchmarks/checkout_ab.py {args.old} {args.new} --rounds {args.rounds}",
           what="compile and simulated step time; ratio new / old")


if __name__ == "__main__":
    main()
