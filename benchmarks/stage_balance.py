"""Stage cuts balanced by cost against layer-count cuts, on gloo at pp=2: each rank's idle time and
the step time of 1F1B on a Hugging Face Llama whose head and loss weigh several layers.

    python benchmarks/stage_balance.py [--layers 8] [--vocab 16384] [--microbatches 8] [--rounds 7] [--append]

Two gloo processes, each pinned with its threads to a core of its own, one compute thread (as
benchmarks/zero_bubble.py). Two programs of the same model and batch, trained side by side in
rounds (one AdamW step of each per round, the order alternating, each step fenced by barriers):
`stage_cuts=[layers // 2]` (the even layer counts) and the default cut, priced on one core's rates
(`--gflops`, `--gb-s`: a Hardware preset's with those numbers; passes/stage_balance.py). Both first take one step from the same weights and
their losses must agree (1e-5). Per program: the layers of each stage, the predicted forward
seconds of each stage, and per rank the median idle time (from the step's start to the last action
of any rank, less its own F and B) and the median step time; then the median of per-round step
time ratios (balanced / even).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from autoshard import autoshard  # noqa: E402
from self_launch import run_workers  # noqa: E402
from zero_bubble import ALLOCATOR, one_core, rank_idle, timed  # noqa: E402

PROGRAMS = ("even", "balanced")


def build(args: argparse.Namespace):
    import transformers as hf
    cfg = hf.LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=args.seq, tie_word_embeddings=False)
    torch.manual_seed(0)
    return hf.LlamaForCausalLM(cfg)


def _batch(args: argparse.Namespace, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, args.vocab, (args.microbatches * args.micro_size, args.seq), generator=gen)
    return {"input_ids": ids, "labels": ids.clone()}


def worker(args: argparse.Namespace) -> None:
    os.sched_setaffinity(0, {int(os.environ["LOCAL_RANK"]) % os.cpu_count()})
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    example = {k: v[:args.micro_size] for k, v in _batch(args, 0).items()}
    progs = {name: autoshard(build(args), pp=2, microbatches=args.microbatches, example_kwargs=example,
                             hardware=one_core(args),
                             stage_cuts=[args.layers // 2] if name == "even" else None)
             for name in PROGRAMS}
    runtimes = {name: p.distributed() for name, p in progs.items()}
    opts = {name: torch.optim.AdamW(rt.parameters(), lr=1e-4) for name, rt in runtimes.items()}
    batches = [_batch(args, 1), _batch(args, 2)]
    first = {name: timed(lambda rt=rt: float(rt.train_step(**batches[0])), opts[name])[1]
             for name, rt in runtimes.items()}
    wall = {n: [] for n in PROGRAMS}
    idle = {n: [] for n in PROGRAMS}
    for r in range(args.warmup + args.rounds):
        for name in (PROGRAMS if r % 2 == 0 else PROGRAMS[::-1]):
            seconds = timed(lambda: float(runtimes[name].train_step(**batches[r % 2])), opts[name])[0]
            idle_now = rank_idle(runtimes[name])
            if r >= args.warmup:
                wall[name].append(seconds)
                idle[name].append(idle_now)
    gathered: list = [None] * 2
    dist.all_gather_object(gathered, {n: statistics.median(v) for n, v in idle.items()})
    if dist.get_rank() == 0:
        print(json.dumps({
            "loss_agree": abs(first["balanced"] - first["even"]) / abs(first["even"]),
            "counts": {n: p.stage_counts for n, p in progs.items()},
            "predicted": {n: p.predicted_stage_seconds for n, p in progs.items()},
            "wall": {n: statistics.median(v) for n, v in wall.items()},
            "ratio": statistics.median(b / e for b, e in zip(wall["balanced"], wall["even"])),
            "idle": gathered}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def _table(out: dict) -> str:
    from tabulate import tabulate
    rows = [[n, "+".join(map(str, out["counts"][n])), " / ".join(f"{s * 1e3:.2f}" for s in out["predicted"][n]),
             f"{out['idle'][0][n] * 1e3:.1f}", f"{out['idle'][1][n] * 1e3:.1f}", f"{out['wall'][n] * 1e3:.1f}"]
            for n in PROGRAMS]
    table = tabulate(rows, headers=["cut", "layers per stage", "predicted forward ms",
                                    "rank 0 idle ms", "rank 1 idle ms", "step ms"], tablefmt="github")
    return (f"{table}\n\nbalanced / even step time, median of per-round ratios: {out['ratio']:.3f}; "
            f"first-step losses agree to {out['loss_agree']:.1e}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=16384)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--micro-size", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--gflops", type=float, default=50.0, help="one core's matmul rate the cut is priced at")
    ap.add_argument("--gb-s", type=float, default=10.0, help="one core's memory rate the cut is priced at")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--append", action="store_true")
    ap.add_argument("--worker", action="store_true")
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    out = run_workers(__file__, sys.argv[1:], env=ALLOCATOR)
    if out["loss_agree"] > 1e-5:
        sys.exit(f"stage_balance: the two cuts' first losses differ by {out['loss_agree']:.2e}")
    table = _table(out)
    print(table)
    if args.append:
        from results import append_result
        shape = (f"HF Llama, {args.layers} layers, hidden {args.hidden}, vocabulary {args.vocab}, {args.microbatches} "
                 f"microbatches of {args.micro_size} x {args.seq} tokens, 1F1B, 2 gloo processes pinned to a core each")
        append_result("Stage cuts balanced by cost against layer counts at pp=2",
                      "python benchmarks/stage_balance.py " + " ".join(sys.argv[1:]), shape, table)


if __name__ == "__main__":
    main()
