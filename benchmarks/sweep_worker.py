"""One configuration of benchmarks/planner_sweep.py, under torchrun: measured peak bytes and step time per rank.

    torchrun --standalone --nproc-per-node 2 -m benchmarks.sweep_worker --tp 2 --microbatches 2 --recompute full
    torchrun --standalone --nproc-per-node 2 -m benchmarks.sweep_worker --model llama --dp 2 --distributed-optimizer

Trains one of benchmarks/sweep_models.py's models (default: the GPT) with AdamW (or the distributed optimizer) through `MeshRuntime.train_step`: two warm-up steps, then one step
under `autoshard.testing.memory.PeakBytes` (on top of the parameters and optimizer state already
live) and `--steps` timed steps, each fenced by barriers. Each rank also predicts its peak from its own
graphs (planning/graph_memory.py) before it runs. Rank 0 prints one JSON line per rank.
Denormals are flushed while it measures and the setting is put back after (the test suite runs it
as a job of a launch shared with other checks: tests/launches.py).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist

from autoshard import autoshard
from autoshard.planning.graph_memory import rank_memory_of
from autoshard.runtime.distributed_optimizer import DistributedOptimizer
from autoshard.testing.launch import run_checker
from autoshard.testing.memory import PeakBytes, state_bytes
from benchmarks.sweep_models import GPT_SHAPE, SWEEP_MODELS, VOCAB

SHAPE = GPT_SHAPE
MICRO = 2          # sequences per microbatch


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt", choices=sorted(SWEEP_MODELS))
    for name in ("tp", "pp", "dp", "ep", "microbatches"):
        ap.add_argument(f"--{name}", type=int, default=1)
    # not --virtual: torchrun reads any prefix of its --virtual-local-rank as its own
    ap.add_argument("--virtual-pipeline", dest="virtual", type=int, default=1)
    ap.add_argument("--recompute", default="none")
    ap.add_argument("--sp", action="store_true")
    ap.add_argument("--schedule", default=None, help="a pipeline schedule (runtime/schedules.py); default 1F1B / interleaved")
    ap.add_argument("--distributed-optimizer", action="store_true")
    ap.add_argument("--zero", type=int, default=1, choices=(1, 2, 3),
                    help="2, 3: gradients, and parameters too, divided over dp (implies --distributed-optimizer)")
    ap.add_argument("--micro", type=int, default=MICRO, help="sequences per microbatch")
    ap.add_argument("--steps", type=int, default=9,
                    help="timed steps (their median: a step of these runs varies by 10-20%% from one to the next)")
    return ap


def split_of(args: argparse.Namespace) -> dict[str, object]:
    """autoshard's arguments for the parsed configuration."""
    return dict(tp=args.tp, pp=args.pp, dp=args.dp, ep=args.ep, virtual=args.virtual, microbatches=args.microbatches,
                recompute=args.recompute, sequence_parallel=args.sp, schedule=args.schedule, zero=args.zero)


def main() -> None:
    args = parser().parse_args()
    run_checker(lambda: _measured(args))


def _measured(args: argparse.Namespace) -> bool:
    torch.set_flush_denormal(True)    # tiny gradients made denormal products 30x slower (RESULTS.md)
    try:
        _measure(args)
    finally:
        torch.set_flush_denormal(False)
    return True


def _measure(args: argparse.Namespace) -> None:
    spec = SWEEP_MODELS[args.model]
    model = spec.model()
    rows = args.dp * args.microbatches * args.micro
    gen = torch.Generator().manual_seed(0)

    def batch() -> dict[str, torch.Tensor]:
        ids = torch.randint(0, VOCAB, (rows, spec.seq), generator=gen)
        return {spec.tokens: ids, spec.labels: ids}
    example = {k: v[:args.micro] for k, v in batch().items()}
    prog = autoshard(model, **split_of(args), example_kwargs=example)
    rt = prog.distributed(mesh=True)
    del model
    args.distributed_optimizer = args.distributed_optimizer or args.zero > 1
    if args.distributed_optimizer:
        opt = DistributedOptimizer(rt, torch.optim.AdamW, lr=1e-4)
    else:
        opt = torch.optim.AdamW(rt.parameters(), lr=1e-4)
    # the prediction read off this rank's own graphs (planning/graph_memory.py), before anything runs
    graph = rank_memory_of(prog, rt.pp_rank, tp_rank=rt.tp_rank, data_rank=rt.dp_rank,
                           distributed_optimizer=args.distributed_optimizer)

    def step():
        rt.train_step(**batch())
        opt.step()
        opt.zero_grad()
    for _ in range(2):
        step()
    params = list(rt.parameters())
    # what a rank holds between steps: parameters and buffers, optimizer state, the runtime's gradient buffers
    grads = [part.buffer.data for part in rt.grads.parts]
    grads += [flat.shard for flat in getattr(opt, "parts", []) if hasattr(flat, "shard")]    # zero=3's parameters
    state = opt.optimizer.state if args.distributed_optimizer else opt.state
    base = state_bytes(params + list(rt.buffers()) + [t for s in state.values() for t in s.values()] + grads)
    # the lowest of three steps' peaks: the same step measured 262 KB (0.56%) more in one step of three
    # (tp=2 GPT, in a launch shared with other checks; the other two within 0.03% of its graphs), a
    # release PeakBytes saw late (it learns of one from the storage's finalizer), not a tensor the
    # step's graphs hold
    peaks = []
    for _ in range(3):
        with PeakBytes(base=base) as peak:
            step()
        peaks.append(peak.peak)
    times = []
    for _ in range(args.steps):
        dist.barrier()
        t0 = time.perf_counter()
        step()
        dist.barrier()
        times.append(time.perf_counter() - t0)
    mine = {"rank": dist.get_rank(), "tp_rank": rt.tp_rank, "pp_rank": rt.pp_rank, "dp_rank": rt.dp_rank,
            "params": sum(p.numel() for p in params), "state_bytes": base, "peak_bytes": min(peaks),
            "graph_bytes": graph.peak,
            "step_s": statistics.median(times)}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if dist.get_rank() == 0:
        print("\n".join(json.dumps(r) for r in everyone), flush=True)


if __name__ == "__main__":
    main()
