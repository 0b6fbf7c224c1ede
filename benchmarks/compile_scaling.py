"""Compile time of autoshard against bare torch.export, as layers grow (meta-device models).

    .venv/bin/python benchmarks/compile_scaling.py [--layers 2 4 8 16 32] [--tp 4] [--append]
    .venv/bin/python benchmarks/compile_scaling.py --layers 16 32 64 128 --hidden 25600 --heads 160 \
        --tp 8 --pp 8 --virtual 2          # the paper's 1T shape (128 layers), pipelined
    .venv/bin/python benchmarks/compile_scaling.py --layers 128 --hidden 25600 --heads 160 \
        --tp 1 --dp 1024 --zero 3          # the 1T shape fully sharded over 1024 ranks

Both are timed side by side in one run, on GPT-2-shaped models (default hidden 768, 12 heads) built
on the meta device, so nothing is materialized. "autoshard" is the whole call plus building rank 0's
module (capture, analysis, rewrite, emit) and, with --pp, cutting it into pp x virtual stages;
"export" is torch.export.export alone with the same dynamic-shape settings. The slope is a
least-squares fit of seconds against layers. With --dp (and --zero), the program is compiled for
that data-parallel mesh, and the last model's pipeline rank 0 has its step walked on meta
(planning/graph_memory.py): its bytes per rank are printed, by cause, with the walk's seconds.
"""
from __future__ import annotations

import argparse
import os
import resource
import time

import torch
from results import report
from tabulate import tabulate
from torch.export import Dim

from autoshard import autoshard
from autoshard.compile import trace_cache

os.environ.pop(trace_cache.ENV, None)   # compile time is what is measured: every compile traces


def gpt2(layers: int, hidden: int = 768, heads: int = 12):
    import transformers as hf
    with torch.device("meta"):
        return hf.GPT2LMHeadModel(hf.GPT2Config(n_layer=layers, n_embd=hidden, n_head=heads, vocab_size=50257))


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def slope(xs: list[float], ys: list[float]) -> float:
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, nargs="+", default=[2, 4, 8, 16, 32])
    ap.add_argument("--tp", type=int, default=4, help="12 heads: tp in 1, 2, 3, 4, 6, 12")
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--virtual", type=int, default=1)
    ap.add_argument("--dp", type=int, default=1)
    ap.add_argument("--zero", type=int, default=1, choices=(1, 2, 3))
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--append", action="store_true", help="append the table to benchmarks/RESULTS.md")
    args = ap.parse_args()

    def compile_(model):
        prog = autoshard(model, tp=args.tp, pp=args.pp, virtual=args.virtual, microbatches=args.pp, dp=args.dp,
                         zero=args.zero)
        rank = prog.rank(0)
        programs.append(prog)
        return prog.stage_graphs(rank.graph_module) if args.pp > 1 else rank
    programs: list = []
    ids = torch.zeros(2, 64, dtype=torch.long)
    kw = {"input_ids": ids, "use_cache": False}
    dyn = {"input_ids": {0: Dim.AUTO, 1: Dim.AUTO}, "use_cache": None}
    shape = dict(hidden=args.hidden, heads=args.heads)
    timed(lambda: autoshard(gpt2(1, **shape), tp=args.tp).rank(0))          # warm-up: imports, first export
    rows, ex, au = [], [], []
    for n in args.layers:
        model = gpt2(n, **shape)
        t_export = timed(lambda: torch.export.export(model, (), kw, dynamic_shapes=dyn, strict=False))
        t_auto = timed(lambda: compile_(model))
        ex.append(t_export)
        au.append(t_auto)
        rows.append([n, f"{t_export:.2f}", f"{t_auto:.2f}", f"{t_auto / t_export:.2f}"])
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    table = tabulate(rows, headers=["layers", "export s", "autoshard s", "ratio"], tablefmt="github")
    fit = (f"slope: export {slope(args.layers, ex):.3f} s/layer, autoshard {slope(args.layers, au):.3f} s/layer; "
           if len(set(args.layers)) > 1 else "")
    fit += f"autoshard / export at {args.layers[-1]} layers: {au[-1] / ex[-1]:.2f}; peak RSS {rss:.2f} GiB"
    mesh = f" --dp {args.dp} --zero {args.zero}" if args.dp > 1 else ""
    if args.dp > 1:
        from autoshard.planning.graph_memory import rank_memory_of
        params = sum(p.numel() for p in model.parameters())
        start = time.perf_counter()
        memory = rank_memory_of(programs[-1], 0)
        fit += (f"\n\n{args.layers[-1]} layers ({params / 1e12:.3f}T parameters) at dp={args.dp} zero={args.zero}, "
                f"bytes per rank (its step walked on meta in {time.perf_counter() - start:.1f} s): {memory.explain()}")
    report(table, fit, append=args.append, title="Compile scaling",
           command=f".venv/bin/python benchmarks/compile_scaling.py --layers {' '.join(map(str, args.layers))} "
                   f"--hidden {args.hidden} --heads {args.heads} --tp {args.tp} --pp {args.pp} "
                   f"--virtual {args.virtual}{mesh} --append",
           what=f"GPT-2 shape (hidden {args.hidden}, {args.heads} heads) on meta, tp={args.tp}, pp={args.pp}, "
                f"virtual={args.virtual}" + (f", dp={args.dp}, zero={args.zero}" if args.dp > 1 else ""))
    # a loose guard against a quadratic blow-up (it used to be a timed unit test): autoshard's cost
    # per export second may not grow 2.5-fold from the fewest layers to the most
    growth = (au[-1] / ex[-1]) / (au[0] / ex[0])
    if len(args.layers) > 1 and growth > 2.5:
        raise SystemExit(f"autoshard / export grew {growth:.2f}-fold from {args.layers[0]} to {args.layers[-1]} layers: "
                         "the compile is no longer linear in the layers")


if __name__ == "__main__":
    main()
