"""The distributed optimizer on CPU gloo: bytes per parameter per rank against Megatron's accounting,
and step time with the gradient reduction overlapped with backward against reduced after it.

    torchrun --standalone --nproc-per-node 2 benchmarks/distributed_optimizer.py --dp 2 [--append]

Memory (measured from the tensors each rank holds after a step): `DistributedOptimizer` with
`shard=False` (every rank keeps everything) and sharded (flat parameters + fp32 gradient buffer +
fp32 main parameters unless the weights are fp32 + AdamW's moments, its 1/dp of the last two,
padding included), each divided by the parameters the rank holds, beside
`planning.memory_model.param_bytes` (what the cost model uses): Megatron's 18 and 6 + 12/dp with
`--dtype bfloat16`, 16 and 8 + 8/dp with fp32.

Time: one DistributedOptimizer, its buckets' reductions started inside backward (overlap) or after
it, alternating step by step on the same runtime (side by side on this shared machine); the median
of each. Rank 0 prints one table, appended to RESULTS.md with --append.
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
from autoshard.testing.launch import leave  # noqa: E402
from autoshard.planning.memory_model import param_bytes  # noqa: E402
from autoshard.runtime.distributed_optimizer import DistributedOptimizer  # noqa: E402
from autoshard.testing.models import VOCAB, build_model  # noqa: E402


def _batch(rows: int, seq: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (rows, seq), generator=gen)
    return {"input_ids": ids, "labels": ids}


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _runtime(args):
    model = build_model("gpt2", layers=args.layers, hidden=args.hidden, heads=args.heads).to(getattr(torch, args.dtype))
    prog = autoshard(model, dp=args.dp, microbatches=args.microbatches,
                     example_kwargs={k: v[:2] for k, v in _batch(2, args.seq, 0).items()})
    return prog.distributed(mesh=True)


def main(args: argparse.Namespace) -> None:
    dist.init_process_group("gloo")
    rows = args.dp * args.microbatches * args.rows
    plain_rt = _runtime(args)
    plain = DistributedOptimizer(plain_rt, torch.optim.AdamW, lr=1e-4, shard=False)
    plain_rt.train_step(**_batch(rows, args.seq, 1))
    plain.step()
    n = sum(p.numel() for p in plain_rt.parameters())
    plain_sizes = plain.state_bytes()
    plain_bytes = sum(plain_sizes.values())
    del plain_rt, plain
    rt = _runtime(args)
    opt = DistributedOptimizer(rt, torch.optim.AdamW, lr=1e-4, bucket_bytes=args.bucket_mib * 2 ** 20)
    times: dict[bool, list[float]] = {True: [], False: []}
    for step in range(args.warmup + 2 * args.rounds):
        overlap = step % 2 == 0
        opt.overlap = overlap
        batch = _batch(rows, args.seq, 2 + step)
        dist.barrier()
        start = time.perf_counter()
        rt.train_step(**batch)
        opt.step()
        elapsed = time.perf_counter() - start
        opt.zero_grad()
        if step >= args.warmup:
            times[overlap].append(elapsed)
    sizes = opt.state_bytes()
    zero_bytes = sum(sizes.values())
    med = {k: statistics.median(v) for k, v in times.items()}
    if dist.get_rank() == 0:
        weight = torch.finfo(getattr(torch, args.dtype)).bits // 8
        plain_acc, zero_acc = (param_bytes(weight, 4, dp=args.dp, distributed_optimizer=z).total for z in (False, True))
        table = "\n".join([
            "| dp | weights | params/rank | not sharded B/param (accounting) | sharded B/param (accounting) "
            "| state + main B/rank not sharded -> sharded | step s, reduce after backward | step s, overlapped | ratio |",
            "|---|---|---|---|---|---|---|---|---|",
            f"| {args.dp} | {args.dtype} | {n} | {plain_bytes / n:.3f} ({plain_acc:g}) | {zero_bytes / n:.3f} ({zero_acc:g}) "
            f"| {plain_sizes['optimizer_state'] + plain_sizes['main_params']} -> "
            f"{sizes['optimizer_state'] + sizes['main_params']} | {med[False]:.3f} | {med[True]:.3f} "
            f"| {med[True] / med[False]:.3f} |"])
        summary = (f"GPT-2 {args.layers} layers, hidden {args.hidden}, seq {args.seq}, {rows} rows a step, "
                   f"{args.microbatches} microbatches, buckets of {args.bucket_mib} MiB ({opt.buckets}); "
                   f"median of {args.rounds} steps each, alternating.")
        print(table)
        print(summary)
        if args.append:
            from results import append_result
            append_result("Distributed optimizer: bytes per parameter and overlapped gradient reduction",
                          "torchrun --standalone --nproc-per-node " f"{args.dp} benchmarks/distributed_optimizer.py "
                          f"--dp {args.dp} --dtype {args.dtype}", "CPU gloo, OMP_NUM_THREADS=1", f"{table}\n\n{summary}")
    leave(0)          # not a plain exit: gloo's threads can abort the interpreter's finalization


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--rows", type=int, default=4, help="rows per microbatch")
    ap.add_argument("--microbatches", type=int, default=2)
    ap.add_argument("--bucket-mib", type=float, default=4.0)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--append", action="store_true")
    main(ap.parse_args())
