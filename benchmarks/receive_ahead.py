"""Receiving ahead on gloo (runtime/p2p.py): how long a pipeline stage waits in its receive when the
message was sent well before it asked, with the receive posted by the action itself ("at need") and
posted once the receive before it was done ("ahead").

    python benchmarks/receive_ahead.py [--mib 0.5 8] [--rounds 6] [--append]

Two gloo processes, one compute thread each, not pinned (as torchrun starts them). Rank 0 plays the
sending stage: per microbatch it computes for `--send-ms` (single-threaded GEMMs) and sends one
activation of the given size through autoshard's Transfer. Rank 1 plays the receiving stage: it
receives, then computes for `--recv-ms`, longer, so every message is sent before its receive is
asked for and what rank 1 waits is the transfer itself, not the sender. Per round both ways run one
after the other (the order alternating), 8 microbatches a step, 3 steps; the first two receives of
each step are left out (the first has no receive before it to post it). Reported: the median and the
mean wait per receive over the rounds, and the median of per-round ratios of the mean waits.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from autoshard.runtime.p2p import FORWARD, Receive, Transfer  # noqa: E402
from results import report  # noqa: E402
from self_launch import run_workers  # noqa: E402

MICROBATCHES, STEPS = 8, 3


def _compute(ms: float, a: torch.Tensor, b: torch.Tensor) -> None:
    end = time.perf_counter() + ms / 1e3
    while time.perf_counter() < end:
        a @ b


def _waits(ahead: bool, numel: int, args: argparse.Namespace) -> list[float]:
    """Rank 1's seconds in each receive of STEPS steps (rank 0 returns [])."""
    rank = dist.get_rank()
    a, b = torch.randn(256, 512), torch.randn(512, 512)
    transfer = Transfer(2, "cpu", rank)
    transfer.ahead = ahead
    waits = []
    for _ in range(STEPS):
        dist.barrier()
        if rank == 1:
            transfer.expect([Receive(FORWARD, 1, i, 0) for i in range(MICROBATCHES)])
        for i in range(MICROBATCHES):
            if rank == 0:
                _compute(args.send_ms, a, b)
                transfer.send([torch.randn(numel)], 1, 0, i, FORWARD)
                continue
            start = time.perf_counter()
            transfer.recv_forward(1, 0, 1, i)
            if i >= 2:
                waits.append(time.perf_counter() - start)
            _compute(args.recv_ms, a, b)
        transfer.wait_sends()
    return waits


def worker(args: argparse.Namespace) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    out = {}
    for mib in args.mib:
        numel = int(mib * 2 ** 20) // 4
        means: dict[bool, list[float]] = {True: [], False: []}
        every: dict[bool, list[float]] = {True: [], False: []}
        for r in range(args.rounds):
            for ahead in ((True, False) if r % 2 else (False, True)):
                waits = _waits(ahead, numel, args)
                if waits:
                    means[ahead].append(statistics.mean(waits))
                    every[ahead] += waits
        if dist.get_rank() == 1:
            out[mib] = {name: {"median_ms": 1e3 * statistics.median(every[ahead]),
                               "mean_ms": 1e3 * statistics.mean(every[ahead])}
                        for name, ahead in (("at need", False), ("ahead", True))}
            out[mib]["ratio"] = statistics.median(x / y for x, y in zip(means[True], means[False]))
    if dist.get_rank() == 1:
        print(json.dumps(out), flush=True)
    dist.destroy_process_group()


def _table(out: dict, args: argparse.Namespace) -> str:
    lines = ["| message MiB | wait at need, median ms | mean ms | wait ahead, median ms | mean ms | "
             "ahead / at need (median of per-round means) |", "| --- | --- | --- | --- | --- | --- |"]
    for mib, r in out.items():
        lines.append(f"| {mib} | {r['at need']['median_ms']:.3f} | {r['at need']['mean_ms']:.3f} | "
                     f"{r['ahead']['median_ms']:.3f} | {r['ahead']['mean_ms']:.3f} | {r['ratio']:.2f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=float, nargs="+", default=[0.5, 8.0], help="message sizes, MiB")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--send-ms", type=float, default=20.0, help="the sender's compute per microbatch")
    ap.add_argument("--recv-ms", type=float, default=30.0, help="the receiver's compute per microbatch")
    ap.add_argument("--append", action="store_true")
    ap.add_argument("--worker", action="store_true")
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    if args.recv_ms <= args.send_ms:
        sys.exit(f"receive_ahead: --recv-ms {args.recv_ms} must exceed --send-ms {args.send_ms}, or the wait is the "
                 f"sender's")
    out = run_workers(__file__, sys.argv[1:], env={"OMP_NUM_THREADS": "1"})
    shape = (f"2 gloo processes, {MICROBATCHES} microbatches x {STEPS} steps a round, {args.rounds} rounds, "
             f"sender {args.send_ms:g} ms and receiver {args.recv_ms:g} ms of compute per microbatch")
    summary = "ahead / at need under 1.00: a receive posted ahead waited less than one posted by its action"
    report(_table(out, args), summary, append=args.append,
           title="Receiving ahead on gloo: a stage's wait in its receive",
           command="python benchmarks/receive_ahead.py " + " ".join(sys.argv[1:]), what=shape)


if __name__ == "__main__":
    main()
