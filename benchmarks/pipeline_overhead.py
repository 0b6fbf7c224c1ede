"""Pipeline overhead: autoshard's 1F1B and interleaved schedules against torch.distributed.pipelining.

    torchrun --standalone --nproc-per-node 2 benchmarks/pipeline_overhead.py [--rounds 10] [--append]

One seeded Hugging Face Llama (from a config, random weights) is built four times on each of two
gloo processes and trained by four programs side by side:

- autoshard 1F1B (pp=2) and interleaved (pp=2, v=2), loss in the graph;
- torch.distributed.pipelining's Schedule1F1B and ScheduleInterleaved1F1B on a manual split: each
  stage is the embedding (first), its share of decoder layers, the final norm and head (last); every
  stage computes its rotary table as HF's model does; the loss function is HF's shifted
  cross-entropy.

First all four train two SGD steps on the same batches and their losses must agree (relative error
<= 1e-5): the programs compute the same thing. Then rounds of one step of each, the order rotating
per round, each step fenced by barriers. Measured per step: CPU seconds of both processes together
(`time.process_time`, gloo's threads included) and wall seconds; reported: medians and the median
of per-round ratios. Counted once per program (not timed): aten ops per step on each rank
(a dispatch mode) and point-to-point messages sent per step. Exit status 1 if the losses disagree.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from autoshard import autoshard  # noqa: E402
from autoshard.testing.launch import agree, run_checker  # noqa: E402
from benchmarks.llama_stages import LlamaStage, shifted_cross_entropy  # noqa: E402

PROGRAMS = ("autoshard 1f1b", "autoshard interleaved", "torch 1f1b", "torch interleaved")


def build_llama(args: argparse.Namespace) -> nn.Module:
    import transformers as hf
    torch.manual_seed(0)
    cfg = hf.LlamaConfig(num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                         hidden_size=args.hidden, intermediate_size=2 * args.hidden, vocab_size=args.vocab,
                         max_position_embeddings=args.seq)
    return hf.LlamaForCausalLM(cfg)


class TorchPipeline:
    """torch.distributed.pipelining on a manual split: `virtual` stages per rank, round-robin."""

    def __init__(self, model: nn.Module, args: argparse.Namespace, virtual: int):
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B
        rank, pp = dist.get_rank(), dist.get_world_size()
        n_stages = pp * virtual
        if args.layers % n_stages:
            raise SystemExit(f"pipeline_overhead: {args.layers} layers do not split into {n_stages} stages")
        per = args.layers // n_stages
        ids = [rank + pp * k for k in range(virtual)]
        self.modules = [LlamaStage(model, i * per, (i + 1) * per, i == 0, i == n_stages - 1) for i in ids]
        stages = [PipelineStage(m, i, n_stages, torch.device("cpu")) for m, i in zip(self.modules, ids)]
        if virtual == 1:
            self.schedule = Schedule1F1B(stages[0], args.microbatches, loss_fn=shifted_cross_entropy)
        else:
            self.schedule = ScheduleInterleaved1F1B(stages, args.microbatches, loss_fn=shifted_cross_entropy)
        self.last = dist.get_rank() == pp - 1          # the last stage lives on the last rank

    def parameters(self):
        seen = {}
        for m in self.modules:
            for p in m.parameters():
                seen[id(p)] = p
        return list(seen.values())

    def train_step(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        losses: list[torch.Tensor] = []
        if dist.get_rank() == 0:
            self.schedule.step(ids, target=labels, losses=losses)
        else:
            self.schedule.step(target=labels, losses=losses)
        loss = torch.stack(losses).mean().detach() if self.last else torch.zeros(())
        dist.broadcast(loss, src=dist.get_world_size() - 1)         # every rank reports the step's loss
        return loss


class AutoshardPipeline:
    def __init__(self, model: nn.Module, args: argparse.Namespace, virtual: int):
        micro = args.batch // args.microbatches
        example = {"input_ids": torch.zeros(micro, args.seq, dtype=torch.long),
                   "labels": torch.zeros(micro, args.seq, dtype=torch.long)}
        prog = autoshard(model, pp=dist.get_world_size(), virtual=virtual, microbatches=args.microbatches,
                         schedule="interleaved" if virtual > 1 else "1f1b", example_kwargs=example)
        self.runtime = prog.distributed()

    def parameters(self):
        return self.runtime.parameters()

    def train_step(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.runtime.train_step(input_ids=ids, labels=labels)


def _step(program, opt: torch.optim.Optimizer, ids: torch.Tensor, labels: torch.Tensor) -> float:
    opt.zero_grad(set_to_none=True)
    loss = program.train_step(ids, labels)
    opt.step()
    return float(loss)


def _timed(program, opt, ids, labels) -> tuple[float, float]:
    """(CPU seconds of all ranks, wall seconds) of one fenced step."""
    dist.barrier()
    wall, cpu = time.perf_counter(), time.process_time()
    _step(program, opt, ids, labels)
    cpu = torch.tensor(time.process_time() - cpu, dtype=torch.float64)
    dist.barrier()
    wall = time.perf_counter() - wall
    dist.all_reduce(cpu)
    return cpu.item(), wall


class _OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def _counted(step: Callable[[], object]) -> tuple[int, int]:
    """(aten ops, point-to-point sends) of one call of `step` on this rank. Both libraries post every
    send as a `dist.P2POp`, so sends are counted at its construction."""
    sends = [0]
    real = dist.P2POp.__init__

    def counting_init(self, op, *a, **kw):
        sends[0] += op is dist.isend
        real(self, op, *a, **kw)

    dist.P2POp.__init__ = counting_init
    try:
        with _OpCounter() as ops:
            step()
    finally:
        dist.P2POp.__init__ = real
    return ops.count, sends[0]


def main(args: argparse.Namespace) -> bool:
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen),
                torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen)) for _ in range(3)]
    programs = {}
    for name in PROGRAMS:
        virtual = 2 if name.endswith("interleaved") else 1
        make = AutoshardPipeline if name.startswith("autoshard") else TorchPipeline
        program = make(build_llama(args), args, virtual)
        programs[name] = (program, torch.optim.SGD(program.parameters(), lr=args.lr))

    losses = {name: [_step(p, o, *b) for b in batches[:2]] for name, (p, o) in programs.items()}
    ref = losses["torch 1f1b"]
    worst = max(abs(a - b) / abs(b) for got in losses.values() for a, b in zip(got, ref))
    counts = {name: _counted(lambda p=p, o=o: _step(p, o, *batches[2])) for name, (p, o) in programs.items()}

    cpu = {n: [] for n in PROGRAMS}
    wall = {n: [] for n in PROGRAMS}
    for r in range(args.warmup + args.rounds):
        order = PROGRAMS[r % 4:] + PROGRAMS[: r % 4]
        for name in order:
            c, w = _timed(*programs[name], *batches[r % 3])
            if r >= args.warmup:
                cpu[name].append(c)
                wall[name].append(w)

    def ratio(a: str, b: str, table: dict) -> float:
        return statistics.median(x / y for x, y in zip(table[a], table[b]))

    result = {"losses": {n: [round(x, 6) for x in v] for n, v in losses.items()}, "loss_rel": worst,
              "cpu_ms": {n: 1e3 * statistics.median(v) for n, v in cpu.items()},
              "wall_ms": {n: 1e3 * statistics.median(v) for n, v in wall.items()},
              "ops": {n: c[0] for n, c in counts.items()}, "sends": {n: c[1] for n, c in counts.items()},
              "ratios_cpu": {"interleaved ours/torch": ratio("autoshard interleaved", "torch interleaved", cpu),
                             "1f1b ours/torch": ratio("autoshard 1f1b", "torch 1f1b", cpu),
                             "ours interleaved/1f1b": ratio("autoshard interleaved", "autoshard 1f1b", cpu),
                             "torch interleaved/1f1b": ratio("torch interleaved", "torch 1f1b", cpu)},
              "ratios_wall": {"interleaved ours/torch": ratio("autoshard interleaved", "torch interleaved", wall),
                              "1f1b ours/torch": ratio("autoshard 1f1b", "torch 1f1b", wall)}}
    ok = agree(result, worst <= 1e-5)
    if rank == 0 and ok and args.append:
        _append(args, result)
    return ok


def _append(args: argparse.Namespace, result: dict) -> None:
    from results import append_result
    from tabulate import tabulate
    rows = [(n, f"{result['cpu_ms'][n]:.1f}", f"{result['wall_ms'][n]:.1f}", result["ops"][n], result["sends"][n])
            for n in PROGRAMS]
    table = tabulate(rows, headers=("program", "CPU ms (2 ranks)", "wall ms", "aten ops/step (rank 0)",
                                    "sends/step (rank 0)"), tablefmt="github")
    ratios = tabulate(list(result["ratios_cpu"].items()) + [(f"{k} (wall)", v) for k, v in result["ratios_wall"].items()],
                      headers=("ratio (median of rounds)", "value"), tablefmt="github", floatfmt=".3f")
    shape = (f"HF Llama {args.layers} layers, hidden {args.hidden}, {args.heads} heads ({args.kv_heads} kv), vocab "
             f"{args.vocab}, batch {args.batch} x seq {args.seq}, {args.microbatches} microbatches, "
             f"{args.rounds} rounds, loss rel {result['loss_rel']:.1e}")
    append_result("Pipeline overhead vs torch.distributed.pipelining",
                  " ".join(["torchrun", "--nproc-per-node", "2"] + sys.argv), shape, table + "\n\n" + ratios)


def cli() -> None:
    """The command line (also run as a job of the test suite's launches: tests/launches.py)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for flag, default in (("--layers", 8), ("--hidden", 256), ("--heads", 8), ("--kv-heads", 2), ("--vocab", 4096),
                          ("--seq", 128), ("--batch", 8), ("--microbatches", 4), ("--rounds", 10), ("--warmup", 2)):
        ap.add_argument(flag, type=int, default=default)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--append", action="store_true")
    args = ap.parse_args()
    run_checker(lambda: main(args))


if __name__ == "__main__":
    cli()
