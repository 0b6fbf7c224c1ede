"""Expert parallelism on CPU gloo: tokens per second and memory per rank against the replicated experts.

    torchrun --standalone --nproc-per-node 2 benchmarks/expert_parallel.py --dp 2 --ep 2 [--append]

One seeded Mixtral-style decoder from a transformers config (random weights), compiled twice on the
same dp: experts replicated on every rank (ep=1: each rank runs every expert on its own tokens, the
experts' gradients all-reduced over dp) and divided over ep ranks (tokens exchanged with
all-to-all). Both train with AdamW, alternating step by step on the same batches (side by side on
this shared machine); the median step of each gives tokens/s (the global batch's tokens over the
step). Memory per rank is measured from the tensors each rank holds after a step: parameters,
gradients and AdamW's two moments, all of them and the experts' alone. The all-to-all bytes one rank
sent per step are reported from its counter. Rank 0 prints one table, appended to RESULTS.md with
--append.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from autoshard import autoshard  # noqa: E402
from autoshard.testing.launch import agree, run_checker  # noqa: E402


def _model(args):
    import transformers as hf
    torch.manual_seed(0)
    cfg = hf.MixtralConfig(num_hidden_layers=args.layers, hidden_size=args.hidden, num_attention_heads=8,
                           num_key_value_heads=2, intermediate_size=args.ffn, num_local_experts=args.experts,
                           num_experts_per_tok=2, vocab_size=args.vocab, max_position_embeddings=args.seq)
    return hf.MixtralForCausalLM(cfg)


def _batch(args, rows: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, args.vocab, (rows, args.seq), generator=gen)
    return {"input_ids": ids, "labels": ids}


def _bytes(rt, opt, experts_only: bool) -> int:
    total = 0
    for name, p in rt.named_parameters():
        if experts_only and ".experts." not in name:
            continue
        state = [v for v in opt.state.get(p, {}).values() if isinstance(v, torch.Tensor) and v.dim()]
        total += sum(t.numel() * t.element_size() for t in [p, p.grad, *state] if t is not None)
    return total


def main(args: argparse.Namespace) -> bool:
    rows = args.dp * args.microbatches * args.rows
    runs = {}
    for ep in (1, args.ep):
        prog = autoshard(_model(args), dp=args.dp, ep=ep, microbatches=args.microbatches,
                         example_kwargs={k: v[:args.rows] for k, v in _batch(args, args.rows, 0).items()})
        rt = prog.distributed(mesh=True)
        runs[ep] = (rt, torch.optim.AdamW(rt.parameters(), lr=1e-4))
    times: dict[int, list[float]] = {ep: [] for ep in runs}
    sent: dict[int, int] = {ep: 0 for ep in runs}
    for step in range(args.warmup + args.rounds):
        batch = _batch(args, rows, 1 + step)
        for ep in sorted(runs, key=lambda e: (e + step) % 2):      # alternate which goes first
            rt, opt = runs[ep]
            before = rt.expert_group.sent_bytes if rt.expert_group else 0
            dist.barrier()
            start = time.perf_counter()
            rt.train_step(**batch)
            opt.step()
            elapsed = time.perf_counter() - start
            if step >= args.warmup:
                times[ep].append(elapsed)
                sent[ep] += (rt.expert_group.sent_bytes if rt.expert_group else 0) - before
            if step + 1 < args.warmup + args.rounds:
                opt.zero_grad()
    med = {ep: statistics.median(t) for ep, t in times.items()}
    mem = {ep: (_bytes(*runs[ep], False), _bytes(*runs[ep], True)) for ep in runs}
    peak = torch.tensor([float(mem[ep][0]) for ep in sorted(runs)])
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)       # the busiest rank's bytes
    if dist.get_rank() == 0:
        mib = 2 ** 20
        lines = ["| experts | tokens/s | step s (median) | MiB per rank (max over ranks) | of which experts "
                 "| all-to-all MiB sent per step (rank 0) |", "|---|---|---|---|---|---|"]
        for i, ep in enumerate(sorted(runs)):
            what = "replicated (ep=1)" if ep == 1 else f"divided over ep={ep}"
            lines.append(f"| {what} | {rows * args.seq / med[ep]:.0f} | {med[ep]:.3f} | {peak[i] / mib:.1f} "
                         f"| {mem[ep][1] / mib:.1f} | {sent[ep] / args.rounds / mib:.2f} |")
        ratio = med[args.ep] / med[1]
        table = "\n".join(lines)
        summary = (f"Mixtral-style, {args.layers} layers, hidden {args.hidden}, {args.experts} experts of width "
                   f"{args.ffn}, top-2, vocab {args.vocab}; dp={args.dp}, {rows} x {args.seq} tokens a step in "
                   f"{args.microbatches} microbatches; median of {args.rounds} steps each, alternating. Step time "
                   f"ep={args.ep} / replicated: {ratio:.3f}; memory per rank "
                   f"{peak[1] / peak[0]:.3f} of the replicated (parameters, gradients, AdamW moments).")
        print(table)
        print(summary)
        if args.append:
            from results import append_result
            append_result("Expert parallelism vs replicated experts",
                          f"torchrun --standalone --nproc-per-node {args.dp} benchmarks/expert_parallel.py "
                          f"--dp {args.dp} --ep {args.ep}", "CPU gloo, OMP_NUM_THREADS=1", f"{table}\n\n{summary}")
    cells = {("replicated (ep=1)" if ep == 1 else f"divided over ep={ep}"):
             {"experts_mib": mem[ep][1] / 2 ** 20, "all_to_all_mib": sent[ep] / args.rounds / 2 ** 20} for ep in runs}
    return agree({"rows": cells}, True)


def cli() -> None:
    """The command line (also run as a job of the test suite's launches: tests/launches.py)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for flag, default in (("--dp", 2), ("--ep", 2), ("--layers", 4), ("--hidden", 256), ("--ffn", 512),
                          ("--experts", 8), ("--vocab", 4096), ("--seq", 128), ("--rows", 4), ("--microbatches", 2),
                          ("--rounds", 10), ("--warmup", 2)):
        ap.add_argument(flag, type=int, default=default)
    ap.add_argument("--append", action="store_true")
    args = ap.parse_args()
    run_checker(lambda: main(args))


if __name__ == "__main__":
    cli()
