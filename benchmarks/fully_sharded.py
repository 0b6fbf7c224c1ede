"""Fully sharded data parallelism on gloo (dp=4 by default): autoshard's zero=3 against torch's
own FSDP2 (`fully_shard` on each decoder layer, then on the model) on the same Hugging Face Llama,
weights and batches, with autoshard's zero=1 beside them; memory per rank and step time.

    python benchmarks/fully_sharded.py [--layers 8] [--hidden 256] [--rounds 7] [--append]

--dp gloo processes (four: two to a core on the 2-core machine; the ratios, measured in the same
rounds, are what to read), one compute thread each, glibc told to keep freed memory (zero_bubble.py's
ALLOCATOR). Every program first takes three AdamW steps from the same weights; their losses must
agree within 1e-5. Then, per program and rank:

- held: bytes live between steps (parameters as this rank holds them, gradients, AdamW's state);
- peak: the most bytes live through one step (autoshard.testing.memory.PeakBytes on top of held:
  every tensor an op makes, and storages resized in place, which is how both FSDPs free and refill
  gathered parameters), the lowest of `--peak-steps` steps' (3);
- predicted: autoshard's own prediction of that peak (planning/graph_memory.py, read off the
  rank's graphs), for its programs;
- step: seconds per step, the median over rounds (one step of each program per round, order
  rotating, fenced by barriers), and the median of per-round ratios to FSDP2.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from autoshard import autoshard  # noqa: E402
from autoshard.planning.graph_memory import rank_memory_of  # noqa: E402
from autoshard.runtime.distributed_optimizer import DistributedOptimizer  # noqa: E402
from autoshard.testing.memory import PeakBytes, state_bytes  # noqa: E402

LR = 1e-3


def build(args: argparse.Namespace) -> torch.nn.Module:
    import transformers as hf
    cfg = hf.LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=4,
                         max_position_embeddings=args.seq, tie_word_embeddings=False)
    torch.manual_seed(0)
    return hf.LlamaForCausalLM(cfg).train()


def batch(args: argparse.Namespace, step: int) -> dict[str, torch.Tensor]:
    """The global batch (every rank makes the same one): dp x rows sequences, labels the ids."""
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, args.vocab, (args.dp * args.rows, args.seq), generator=g)
    return {"input_ids": ids, "labels": ids}


class Ours:
    """autoshard at dp=4 with the DistributedOptimizer at `zero`."""

    def __init__(self, args: argparse.Namespace, zero: int):
        example = {k: v[: args.rows] for k, v in batch(args, 0).items()}
        self.prog = autoshard(build(args), dp=args.dp, zero=zero, example_kwargs=example)
        self.rt = self.prog.distributed(mesh=True)
        self.opt = DistributedOptimizer(self.rt, torch.optim.AdamW, lr=LR)

    def step(self, b: dict) -> float:
        loss = self.rt.train_step(**b)
        self.opt.step()
        self.opt.zero_grad()
        return float(loss)

    def held(self) -> int:
        grads = [part.buffer.data for part in self.opt.grads.parts]
        shards = [flat.shard if hasattr(flat, "shard") else flat.flat for flat in self.opt.parts]
        state = [t for s in self.opt.optimizer.state.values() for t in s.values()]
        return state_bytes(list(self.rt.parameters()) + list(self.rt.buffers()) + shards + grads + state)

    def predicted(self) -> int:
        return rank_memory_of(self.prog, 0, data_rank=self.rt.dp_rank, distributed_optimizer=True).peak


class Theirs:
    """torch's FSDP2: fully_shard on every decoder layer, then on the model; each rank its rows."""

    def __init__(self, args: argparse.Namespace):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        self.model, self.rows, self.dp = build(args), args.rows, args.dp
        mesh = init_device_mesh("cpu", (args.dp,))
        for layer in self.model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=LR)

    def step(self, b: dict) -> float:
        r = dist.get_rank()
        mine = {k: v[r * self.rows: (r + 1) * self.rows] for k, v in b.items()}
        loss = self.model(**mine).loss
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        total = loss.detach().clone()
        dist.all_reduce(total)
        return float(total) / self.dp

    def held(self) -> int:
        local = [p.to_local() for p in self.model.parameters()] + list(self.model.buffers())
        state = [t.to_local() if hasattr(t, "to_local") else t for s in self.opt.state.values() for t in s.values()]
        return state_bytes(local + state)


def worker(args: argparse.Namespace) -> None:
    os.sched_setaffinity(0, {int(os.environ["LOCAL_RANK"]) % os.cpu_count()})
    dist.init_process_group("gloo")
    measure(args)
    dist.destroy_process_group()


def measure(args: argparse.Namespace) -> bool:
    """Every program's numbers on this rank; rank 0 prints everyone's as one JSON line."""
    torch.set_num_threads(1)
    makers = {"autoshard zero=3": lambda: Ours(args, 3), "torch FSDP2": lambda: Theirs(args),
              "autoshard zero=1": lambda: Ours(args, 1)}
    programs = {name: make() for name, make in makers.items() if name in ("torch FSDP2", *args.ours)}
    losses = {name: [p.step(batch(args, s)) for s in range(1, 4)] for name, p in programs.items()}
    first = losses["torch FSDP2"]
    agree = max(abs(a - b) / abs(b) for name in losses for a, b in zip(losses[name], first))
    out = {}
    for name, p in programs.items():
        held = p.held()
        peaks = []
        for s in range(args.peak_steps):
            with PeakBytes(base=held) as peak:
                p.step(batch(args, 10 + s))
            peaks.append(peak.peak)
        out[name] = {"held": held, "peak": min(peaks)}
        if isinstance(p, Ours):
            out[name]["predicted"] = p.predicted()
    times = {name: [] for name in programs}
    names = list(programs)
    for r in range(args.rounds + 1):
        for name in names[r % len(names):] + names[: r % len(names)]:
            b = batch(args, 100 + r)
            dist.barrier()
            t0 = time.perf_counter()
            programs[name].step(b)
            dist.barrier()
            if r:                           # round 0 warms up
                times[name].append(time.perf_counter() - t0)
    for name in programs:
        out[name]["step_s"] = statistics.median(times[name])
        out[name]["ratio"] = statistics.median(a / b for a, b in zip(times[name], times["torch FSDP2"]))
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, out)
    if dist.get_rank() == 0:
        params = sum(p.numel() for p in programs["torch FSDP2"].model.parameters())      # DTensors: whole sizes
        print(json.dumps({"ranks": everyone, "agree": agree, "params": params}), flush=True)
    return agree <= 1e-5


def table(result: dict, args: argparse.Namespace) -> str:
    params, dp = result["params"], args.dp
    lines = [f"losses of the programs' first 3 steps agree within {result['agree']:.1e}; "
             f"{params / 1e6:.2f}M parameters, fp32 (16 bytes each with AdamW: {16 * params / 2 ** 20:.1f} MiB "
             f"unsharded, {16 * params / dp / 2 ** 20:.1f} MiB / dp)", "",
             "| program | held MiB (each rank) | peak MiB (each rank) | predicted peak MiB (worst error) | step s | "
             "step / FSDP2 |", "| --- | --- | --- | --- | --- | --- |"]
    mib = 2 ** 20
    def each(rows: list[dict], key: str) -> str:
        return " ".join(f"{r[key] / mib:.1f}" for r in rows) if key in rows[0] else "-"
    for name in result["ranks"][0]:
        rows = [r[name] for r in result["ranks"]]
        error = f" ({max(abs(r['predicted'] / r['peak'] - 1) for r in rows):.2%})" if "predicted" in rows[0] else ""
        lines.append(f"| {name} | {each(rows, 'held')} | {each(rows, 'peak')} | {each(rows, 'predicted')}{error} | "
                     f"{statistics.median(r['step_s'] for r in rows):.3f} | "
                     f"{statistics.median(r['ratio'] for r in rows):.3f} |")
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dp", type=int, default=4, help="processes (one data-parallel mesh)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--rows", type=int, default=2, help="sequences per rank and step")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--peak-steps", type=int, default=3, help="steps whose lowest peak is reported")
    ap.add_argument("--ours", nargs="+", default=["autoshard zero=3", "autoshard zero=1"],
                    choices=["autoshard zero=3", "autoshard zero=1"], help="autoshard's programs beside FSDP2")
    ap.add_argument("--append", action="store_true")
    ap.add_argument("--worker", action="store_true")
    return ap


def cli() -> None:
    """The measurement alone, inside a launch (a job of the test suite's: tests/launches.py)."""
    from autoshard.testing.launch import run_checker
    args = parser().parse_args()
    run_checker(lambda: measure(args))


def main() -> None:
    args = parser().parse_args()
    if args.worker:
        return worker(args)
    from benchmarks.self_launch import run_workers
    from benchmarks.zero_bubble import ALLOCATOR       # (run as a script: its folder is on the path)
    result = run_workers(__file__, sys.argv[1:], nproc=args.dp, env=ALLOCATOR)
    text = table(result, args)
    print(text)
    if args.append:
        from results import append_result
        shape = (f"HF Llama, {args.layers} layers, hidden {args.hidden}, vocabulary {args.vocab}, {args.rows} x "
                 f"{args.seq} tokens per rank, dp={args.dp} on {args.dp} gloo processes (2 cores), AdamW, {args.rounds} rounds")
        append_result("Fully sharded data parallelism against torch's FSDP2",
                      "python benchmarks/fully_sharded.py " + " ".join(sys.argv[1:]), shape, text)


if __name__ == "__main__":
    main()
