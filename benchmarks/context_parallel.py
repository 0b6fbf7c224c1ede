"""Context parallelism at a long sequence: memory per rank, causal work per rank, ring overlap.

    .venv/bin/python benchmarks/context_parallel.py [--seq 8192] [--cps 1 2 4]

Three measurements, printed as markdown tables (benchmarks/RESULTS.md keeps them):

1. Causal work per rank (computed, no run): unmasked (query, key) score entries of each rank's
   tokens under a causal mask, max / mean over the ranks, for the load-balanced pieces
   (parallel/context_parallel.py) and for contiguous chunks.
2. Peak memory per rank of one training step (forward and backward) of two tiny decoders (hidden
   64, 2 layers, 4 heads, vocabulary 128) on one sequence of `--seq` tokens, at cp = 1, 2, 4 (one
   torchrun launch of cp gloo processes each; cp = 1 is the same program on one process): the peak
   of live tensor bytes during the step above those live before it (autoshard/testing/memory.py's
   PeakBytes: every tensor an op returns), for ring attention and for the key/value all-gather.
   nanoGPT calls SDPA with is_causal=True; Hugging Face's Llama (2 kv heads) builds a [S, S] mask
   table, cached once per length (not counted: made before the step), whose [S / cp, S] rows each
   rank cuts every step.
3. Step time of the ring with its sends overlapped with the block's compute and not (median of
   `--steps` steps after one warm-up, the same launch, side by side).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))


def work_balance(seq: int, cps: list[int]) -> list[str]:
    from autoshard.parallel.context_parallel import context_positions
    rows = ["| cp | load-balanced pieces: max / mean | contiguous chunks: max / mean |", "| --- | --- | --- |"]
    for cp in cps:
        if cp == 1:
            continue
        balanced = [int((context_positions(seq, cp, r) + 1).sum()) for r in range(cp)]
        chunk = seq // cp
        contiguous = [sum(range(r * chunk + 1, (r + 1) * chunk + 1)) for r in range(cp)]
        ratio = lambda w: max(w) / (sum(w) / len(w))     # noqa: E731
        rows.append(f"| {cp} | {ratio(balanced):.4f} | {ratio(contiguous):.4f} |")
    return rows


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist
    import transformers as hf

    from autoshard import autoshard
    from autoshard.parallel.ring_attention import RingAttention
    from autoshard.testing.memory import PeakBytes
    dist.init_process_group("gloo")
    cp = dist.get_world_size()
    from autoshard.models import GPT, GPTConfig
    cfg = hf.LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=128, vocab_size=128, max_position_embeddings=args.seq)
    ids = torch.randint(0, 128, (1, args.seq), generator=torch.Generator().manual_seed(0))
    builders = {"llama": (lambda: hf.LlamaForCausalLM(cfg), dict(input_ids=ids, labels=ids)),
                "nanogpt": (lambda: GPT(GPTConfig(n_layer=2, n_head=4, n_embd=64, vocab_size=128,
                                                  block_size=args.seq)), dict(idx=ids, targets=ids))}
    results = []
    for (name, (build, batch)), attention in [(m, a) for m in builders.items()
                                              for a in (("ring", "all_gather") if cp > 1 else ("none",))]:
        torch.manual_seed(0)
        model = build()
        kw = dict(cp=cp, cp_attention=attention) if cp > 1 else {}
        rt = autoshard(model, example_kwargs=batch, **kw).distributed(mesh=True)
        rt.train_step(**batch)                              # warm-up: graphs built, gradient buffers made
        base = sum(t.untyped_storage().nbytes() for t in list(rt.parameters()) + list(rt.buffers()))
        base += sum(p.grad.untyped_storage().nbytes() for p in rt.parameters() if p.grad is not None)
        with PeakBytes(base=base) as peak:
            rt.train_step(**batch)
        modes = [True, False] if attention == "ring" else [None]
        for overlap in modes:
            for m in rt.modules():
                if isinstance(m, RingAttention):
                    m.overlap = overlap
            times = []
            for _ in range(args.steps):
                dist.barrier()
                start = time.perf_counter()
                rt.train_step(**batch)
                times.append(time.perf_counter() - start)
            results.append({"model": name, "cp": cp, "attention": attention, "overlap": overlap,
                            "rank": dist.get_rank(),
                            "peak_mib": (peak.peak - base) / 2 ** 20, "step_s": statistics.median(times)})
    gathered = [None] * cp
    dist.all_gather_object(gathered, results)
    if dist.get_rank() == 0:
        for rows in zip(*gathered):
            print(json.dumps({**rows[0], "peak_mib_max": max(r["peak_mib"] for r in rows),
                              "step_s_max": max(r["step_s"] for r in rows)}), flush=True)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--cps", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--worker", action="store_true")
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    print(f"## causal work per rank, {args.seq} tokens\n")
    print("\n".join(work_balance(args.seq, args.cps)))
    lines = []
    for cp in args.cps:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={cp}", __file__,
               "--worker", "--seq", str(args.seq), "--steps", str(args.steps)]
        out = subprocess.run(cmd, capture_output=True, text=True, cwd=os.path.dirname(HERE),
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
        if out.returncode != 0:
            sys.exit(f"cp={cp} failed:\n{out.stderr[-3000:]}")
        lines += [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    print(f"\n## one training step, {args.seq} tokens: peak memory and time per rank (the largest rank's)\n")
    print("| model | cp | attention | sends overlapped | peak MiB per rank | step s |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in sorted(lines, key=lambda r: (r["model"], r["cp"])):
        overlap = {True: "yes", False: "no", None: "-"}[r["overlap"]]
        print(f"| {r['model']} | {r['cp']} | {r['attention']} | {overlap} | {r['peak_mib_max']:.1f} | "
              f"{r['step_s_max']:.3f} |")


if __name__ == "__main__":
    main()
