"""How much of each current model rank 0 holds under tensor parallelism (the memory tp is for).

    .venv/bin/python benchmarks/param_share.py [--tp 2 4] [--before OLD_CHECKOUT] [--append]

For each model of autoshard/testing/current_models.py (gpt-oss, Llama 4, DeepSeek-V2/V3, OLMo 2/3,
StableLM, Apertus, JetMoE, MPNet, small configs): rank 0's parameter count over the model's, at each
tp (1/tp where everything is split; embeddings split by vocabulary, norms whole), and the number of
regions left whole by design and otherwise. `--before DIR` also measures another checkout of
autoshard (each measurement is a fresh process with DIR first on PYTHONPATH; give DIR symlinks
`autoshard/passes -> ../passes` and `autoshard/kernels -> ../kernels` so that it imports its own).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from results import report
from tabulate import tabulate

from autoshard.testing.current_models import COMMON, CURRENT_MODELS

_CHILD = """
import json, sys, warnings
warnings.filterwarnings("ignore")
import torch, transformers as hf
from autoshard import autoshard
common, (cfg_name, model_name, extra), tp = json.loads(sys.argv[1]), json.loads(sys.argv[2]), int(sys.argv[3])
torch.manual_seed(0)
model = getattr(hf, model_name)(getattr(hf, cfg_name)(**{**common, **extra})).eval()
try:
    prog = autoshard(model, tp=tp, example_kwargs={"input_ids": torch.randint(0, 128, (2, 16))})
except Exception as e:          # an older checkout may refuse
    print(json.dumps({"refused": f"{type(e).__name__}: {str(e)[:80]}"}))
    sys.exit(0)
total = sum(p.numel() for p in model.parameters())
rank0 = sum(p.numel() for p in prog.rank(0).parameters())
fb = prog.sharding.fallbacks
print(json.dumps({"share": rank0 / total, "params": total,
                  "by_design": sum(1 for f in fb if getattr(f, "by_design", False)),
                  "fallbacks": sum(1 for f in fb if not getattr(f, "by_design", False))}))
"""


def measure(name: str, tp: int, checkout: str | None) -> dict:
    env = dict(os.environ)
    if checkout:
        env["PYTHONPATH"] = os.pathsep.join([os.path.abspath(checkout), env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(COMMON), json.dumps(CURRENT_MODELS[name]), str(tp)],
                         env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--before", help="another checkout of autoshard, measured the same way")
    ap.add_argument("--append", action="store_true", help="append the table to benchmarks/RESULTS.md")
    args = ap.parse_args()
    rows = []
    for name in sorted(CURRENT_MODELS):
        for tp in args.tp:
            now = measure(name, tp, None)
            row = [name, tp, now["params"]]
            if args.before:
                old = measure(name, tp, args.before)
                row.append("refused" if "refused" in old else f"{old['share']:.3f}")
            rows.append(row + [f"{now['share']:.3f}", f"{1 / tp:.3f}", now["by_design"], now["fallbacks"]])
    headers = ["model", "tp", "parameters"] + (["rank 0 share before"] if args.before else []) + \
        ["rank 0 share", "1/tp", "whole by design", "other fallbacks"]
    table = tabulate(rows, headers=headers, tablefmt="github")
    report(table, "rank 0's share: its parameters over the model's (embeddings split by vocabulary; norms, "
           "routers and MLA down-projections whole).", append=args.append,
           title="Parameter share of rank 0 on the current models (issue 35)",
           command=" ".join(["python", "benchmarks/param_share.py", *sys.argv[1:]]),
           what="small configs; a fresh process per measurement")


if __name__ == "__main__":
    main()
