"""Zero-bubble schedules on gloo at pp=2: idle time per rank and step time, against 1F1B and
torch.distributed.pipelining's zero-bubble schedules on the same model and split.

    python benchmarks/zero_bubble.py [--microbatches 4 8] [--rounds 5] [--append]

Two gloo processes, each pinned with all its threads (gloo's too) to a core of its own, one
compute thread (with more processes than cores, idle time means nothing). The model is an input LayerNorm and a stack of identical MLP
blocks (x + W2 gelu(W1 x), hidden 256, FFN 1024) on float inputs with the mean square of the output
as its loss, so every stage does the same work. The norm is where the first stage's B stops (the
batch needs no gradient: B runs down to the first op that reads a weight, and W does the rest), so
that stage's B still computes its first block's input gradient, as every later stage's does; without
it the first stage's B is one matmul in eight short of the last stage's, and the first stage waits
on the last every microbatch. Glibc's allocator is told to keep freed memory (ALLOCATOR). Programs, trained side by side in rounds (one SGD step of each per round,
the order rotating, each step fenced by barriers):

- autoshard 1F1B, ZB-H1 (2 stages) and ZBV, V-Half (4 stages, 2 per rank in a V);
- torch.distributed.pipelining's ScheduleZBVZeroBubble (stages in a V) and ScheduleInterleavedZeroBubble
  (stages round-robin) on a manual split into the same 4 stages of equal blocks.

All programs first take one step from the same weights and their losses must agree (1e-5).
Measured per step: wall time (median over rounds, and the median of per-round ratios); for
autoshard's programs each rank's idle time from its trace (from the step's start to the last
action of any rank, less the time its own F, B and W actions ran). Then the simulator (runtime/schedules.py's `check`) is fed
the F, B and W times ZB-H1 measured (planning/schedule_choice.stage_times) and gives each schedule's
bubble at pp = 4 and 8 for a step ending on every rank together (this runtime's), ZBV's with steps
overlapped (optimizer post-validation, `overlapped_bubble`), and the planner's choice
(choose_schedule) at those times.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from autoshard import autoshard  # noqa: E402
from autoshard.planning.hardware import Hardware, get_hardware  # noqa: E402
from autoshard.planning.schedule_choice import StageTimes, choose_schedule, stage_times  # noqa: E402
from autoshard.runtime.schedules import make_schedule, overlapped_bubble  # noqa: E402
from benchmarks.llama_stages import LlamaStage, shifted_cross_entropy  # noqa: E402
from self_launch import run_workers  # noqa: E402

# One thread per process; glibc keeps freed memory for reuse instead of unmapping large tensors and
# faulting fresh pages in for the next (profiled at m = 8: by default the split schedules' backward
# matmuls ran 7% slower than 1F1B's, with this 3-5%). Every program, ours and torch's, runs so.
ALLOCATOR = {"OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": str(32 * 2 ** 20),
             "MALLOC_TRIM_THRESHOLD_": str(8 * 2 ** 30), "MALLOC_TOP_PAD_": str(256 * 2 ** 20)}
OURS = ("1f1b", "interleaved", "zb-h1", "zbv", "v-half")
AT_NEED = ", receives at need"      # --receive-at-need: the same schedule, each receive posted by its action


def _ours(args: argparse.Namespace) -> tuple[str, ...]:
    """Our programs: every schedule, and with --receive-at-need three of them again without
    receiving ahead."""
    return OURS + (tuple(n + AT_NEED for n in ("1f1b", "zb-h1", "zbv")) if args.receive_at_need else ())
THEIRS = ("torch zbv", "torch interleaved-zb")


class Block(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.up, self.down = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(x)))


class Stack(nn.Module):
    """An input norm and identical blocks; the loss is the output's mean square (balanced stages, no
    embedding or head)."""

    def __init__(self, layers: int, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.blocks = nn.ModuleList(Block(hidden) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x)
        for block in self.blocks:
            x = block(x)
        return x.pow(2).mean()


def _square_mean(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return out.pow(2).mean()


def build(args: argparse.Namespace) -> nn.Module:
    torch.manual_seed(0)
    if args.model == "mlp":
        return Stack(args.layers, args.hidden)
    import transformers as hf
    cfg = hf.LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=max(1, args.hidden // 64),
                         num_key_value_heads=max(1, args.hidden // 128), max_position_embeddings=args.seq,
                         tie_word_embeddings=False)
    return hf.LlamaForCausalLM(cfg)


def one_core(args: argparse.Namespace) -> Hardware:
    """One core's rates (--gflops, --gb-s), what the stage cuts and schedule="auto" are priced at, and
    a message between two pinned gloo processes on this machine: 1.2-1.9 ms from send to receipt
    for 0.5-2 MB (its CPU time is 0.1-0.3 ms: latency, not bandwidth), taken as 1.5 ms."""
    return get_hardware("a100-80gb", peak_tflops=args.gflops / 1e3, hbm_gb_s=args.gb_s, matmul_efficiency=1.0,
                        memory_efficiency=1.0, latency_us=1500.0, nvlink_gb_s=10.0)


def predicted_order(args: argparse.Namespace, m: int, split_backward: float) -> list[str]:
    """The schedules fastest first, as schedule="auto" predicts them from the graph at one core's
    rates, the split costing `split_backward` (B + W over one backward)."""
    example = {k: v[:args.micro_size] for k, v in batches(args, 1)[0].items()}
    hw = get_hardware(one_core(args), split_backward=split_backward)
    return autoshard(build(args), pp=2, microbatches=m, schedule="auto", example_kwargs=example,
                     hardware=hw).schedule_choice.order()


def batches(args: argparse.Namespace, m: int) -> list[dict]:
    """Two batches of m microbatches: float inputs for the MLP stack, token ids and labels (the
    same ids: the model shifts them) for the Llama."""
    gen = torch.Generator().manual_seed(1)
    size = m * args.micro_size
    if args.model == "mlp":
        return [{"x": torch.randn(size, args.seq, args.hidden, generator=gen)} for _ in range(2)]
    out = []
    for _ in range(2):
        ids = torch.randint(0, args.vocab, (size, args.seq), generator=gen)
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


class Ours:
    def __init__(self, name: str, args: argparse.Namespace, m: int, cuts: list[int] | None):
        example = {k: v[:args.micro_size] for k, v in batches(args, 1)[0].items()}
        schedule = name.removesuffix(AT_NEED)
        # the V schedules run on the 4-stage cut torch's stages get (`cuts`; None: the default)
        self.program = autoshard(build(args), pp=2, microbatches=m, schedule=schedule, example_kwargs=example,
                                 virtual=2 if schedule == "interleaved" else None,
                                 stage_cuts=cuts if schedule in ("interleaved", "zbv", "v-half") else None,
                                 hardware=one_core(args))
        self.runtime = self.program.distributed()
        self.runtime.transfer.ahead = not name.endswith(AT_NEED)     # runtime/p2p.py's receiving ahead

    def parameters(self):
        return self.runtime.parameters()

    def step(self, batch: dict) -> float:
        return float(self.runtime.train_step(**batch))

    def idle(self) -> float:
        return rank_idle(self.runtime)


def rank_idle(runtime) -> float:
    """This rank's idle seconds in the runtime's last step: from the step's start (every rank starts
    after the same barrier) to the last action of any rank, less the time its own F, B and W ran."""
    acts = [r for r in runtime.records if r.action.kind in "FBW"]
    end = torch.tensor(max(r.end for r in acts), dtype=torch.float64)
    dist.all_reduce(end, op=dist.ReduceOp.MAX)
    return float(end) - sum(r.end - r.start for r in acts)


class Theirs:
    """torch.distributed.pipelining on 4 stages of equal blocks, 2 per rank."""

    def __init__(self, kind: str, args: argparse.Namespace, m: int, cuts: list[int]):
        from torch.distributed.pipelining import PipelineStage, ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble
        rank, model = dist.get_rank(), build(args)
        bounds = [0, *cuts, args.layers]              # the layers of each of the 4 stages
        mine = [rank, 3 - rank] if kind == "torch zbv" else [rank, rank + 2]
        if args.model == "mlp":
            self.modules = [nn.Sequential(*([model.norm] if s == 0 else []), *model.blocks[bounds[s]:bounds[s + 1]])
                            for s in mine]
        else:
            self.modules = [LlamaStage(model, bounds[s], bounds[s + 1], s == 0, s == 3) for s in mine]
        stages = [PipelineStage(mod, s, 4, torch.device("cpu")) for mod, s in zip(self.modules, mine)]
        make = ScheduleZBVZeroBubble if kind == "torch zbv" else ScheduleInterleavedZeroBubble
        self.schedule = make(stages, m, loss_fn=_square_mean if args.model == "mlp" else shifted_cross_entropy)
        self.first, self.last = 0 in mine, 3 in mine

    def parameters(self):
        return [p for mod in self.modules for p in mod.parameters()]

    def step(self, batch: dict) -> float:
        losses: list[torch.Tensor] = []
        x = batch["x"] if "x" in batch else batch["input_ids"]
        target = torch.zeros(x.shape[0]) if "x" in batch else batch["labels"]
        args = (x,) if self.first else ()
        self.schedule.step(*args, target=target if self.last else None, losses=losses)
        loss = torch.stack(losses).mean().detach() if self.last else torch.zeros(())
        dist.all_reduce(loss)               # the one rank holding the last stage has it
        return float(loss)


def _median_spans(records: list) -> dict[str, float]:
    """This rank's median seconds per B and per W action in a step (0 where it ran none)."""
    return {k: statistics.median([r.end - r.start for r in records if r.action.kind == k] or [0.0]) for k in "BW"}


def timed(step: Callable[[], float], opt) -> tuple[float, float]:
    """One training step (`step()` returns its loss) and `opt`'s update, fenced by barriers on every
    rank: (seconds, loss)."""
    dist.barrier()
    t0 = time.perf_counter()
    loss = step()
    opt.step()
    opt.zero_grad(set_to_none=True)
    dist.barrier()
    return time.perf_counter() - t0, loss


def worker(args: argparse.Namespace) -> None:
    # pinned before the process group starts, so that gloo's threads (sends and receives) run on
    # this rank's core too rather than on the other rank's
    os.sched_setaffinity(0, {int(os.environ["LOCAL_RANK"]) % os.cpu_count()})
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    out = {}
    for m in args.microbatches:
        xs = batches(args, m)
        ours = _ours(args)
        # the V schedules' 4 stages: autoshard's own cut for zbv (balanced by cost), given to torch's too
        programs = {"zbv": Ours("zbv", args, m, None)}
        counts = programs["zbv"].program.stage_counts
        cuts = [sum(counts[:k]) for k in range(1, len(counts))]
        programs.update({name: Ours(name, args, m, cuts) for name in ours if name != "zbv"})
        programs = {name: programs[name] for name in ours}
        programs.update({name: Theirs(name, args, m, cuts) for name in THEIRS})
        opts = {name: torch.optim.SGD(p.parameters(), lr=1e-3) for name, p in programs.items()}
        first = {name: timed(lambda p=p: p.step(xs[0]), opts[name])[1] for name, p in programs.items()}
        agree = max(abs(v - first["1f1b"]) / abs(first["1f1b"]) for v in first.values())
        names = list(programs)
        wall = {n: [] for n in names}
        idle = {n: [] for n in ours}
        split_cost = []         # this rank's (B + W of ZB-H1) / (B of 1F1B), medians per step, per round
        for r in range(args.warmup + args.rounds):
            backward = {}
            for name in names[r % len(names):] + names[:r % len(names)]:
                seconds = timed(lambda: programs[name].step(xs[r % 2]), opts[name])[0]
                step_idle = programs[name].idle() if name in ours else None
                if name in ("1f1b", "zb-h1"):
                    backward[name] = _median_spans(programs[name].runtime.records)
                if r >= args.warmup:
                    wall[name].append(seconds)
                    if name in ours:
                        idle[name].append(step_idle)
            if r >= args.warmup:
                split_cost.append((backward["zb-h1"]["B"] + backward["zb-h1"]["W"]) / backward["1f1b"]["B"])
        fbw = stage_times(programs["zb-h1"].runtime.records) if rank == 1 else None
        gathered: list = [None] * 2
        dist.all_gather_object(gathered, {"idle": {n: statistics.median(v) for n, v in idle.items()},
                                          "split": statistics.median(split_cost),
                                          "fbw": fbw and [fbw.forward, fbw.backward_input, fbw.backward_weight]})
        out[m] = {"loss_agree": agree, "wall": {n: statistics.median(v) for n, v in wall.items()},
                  "ratios": {n: statistics.median(a / b for a, b in zip(wall[n], wall["1f1b"])) for n in names},
                  "vs_torch": {f"{n}/{t}": statistics.median(a / b for a, b in zip(wall[n], wall[t]))
                               for n in ours for t in THEIRS},
                  "idle": [g["idle"] for g in gathered], "fbw": gathered[1]["fbw"],
                  "split": [g["split"] for g in gathered], "cuts": cuts,
                  # as schedule="auto" would see them: the preset's split cost, and the one measured here
                  "predicted": predicted_order(args, m, get_hardware("a100-80gb").split_backward),
                  "predicted_measured": predicted_order(args, m, max(1.0, *(g["split"] for g in gathered))),
                  "counts": {n: programs[n].program.stage_counts for n in ours}}
    if rank == 0:
        print(json.dumps(out), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def _overlapped_zbv(pp: int, m: int, t: StageTimes) -> float:
    """ZBV's bubble with consecutive steps overlapped (post-validation; this runtime's steps end
    together), each chunk costing half a rank's F, B and W."""
    return overlapped_bubble(make_schedule("zbv", pp, 2, m), 2, m, forward_cost=t.forward / 2,
                             backward_cost=t.backward_input / 2, weight_cost=t.backward_weight / 2, placement="v")


def _tables(out: dict, args: argparse.Namespace) -> str:
    lines = []
    for m, r in out.items():
        ours_zb = min(("zb-h1", "zbv", "v-half"), key=lambda n: r["wall"][n])
        lines += [f"**m = {m}** (losses agree to {r['loss_agree']:.1e}; wall ms per step, median of {args.rounds} "
                  f"rounds; ratio: median of per-round ratios to autoshard 1F1B)", "",
                  "| program | wall ms | / 1F1B | idle ms rank 0 | idle ms rank 1 |", "| --- | --- | --- | --- | --- |"]
        ours = _ours(args)
        for n in ours + THEIRS:
            idle = [f"{1e3 * r['idle'][k][n]:.1f}" if n in ours else "-" for k in (0, 1)]
            lines.append(f"| {'autoshard ' + n if n in ours else n} | {1e3 * r['wall'][n]:.1f} | "
                         f"{r['ratios'][n]:.3f} | {idle[0]} | {idle[1]} |")
        ratio_idle = max(r["idle"][k]["zb-h1"] / r["idle"][k]["1f1b"] for k in (0, 1))
        measured = sorted(("1f1b", "interleaved", "zb-h1", "zbv", "v-half"), key=lambda n: r["wall"][n])
        split = max(1.0, *r["split"])
        lines += ["", f"Order, fastest first: measured {', '.join(measured)}; predicted by schedule=\"auto\" from the "
                      f"graph ({args.gflops:g} GFLOP/s, {args.gb_s:g} GB/s, 1.5 ms a message), the split costing the preset's 1.05: "
                      f"{', '.join(r['predicted'])}" + (" (the same)" if measured == r["predicted"] else " (differs)")
                  + f"; costing the {split:.3f} measured here: {', '.join(r['predicted_measured'])}"
                  + (" (the same)" if measured == r["predicted_measured"] else " (differs)")]
        lines += ["", f"Layers per stage: 2-stage programs {r['counts']['1f1b']}, V programs (and torch's) "
                      f"{r['counts']['zbv']}. ZB-H1's B + W over 1F1B's whole backward, per stage (rank 0, rank 1; "
                      f"medians of per-round ratios): {r['split'][0]:.3f}, {r['split'][1]:.3f}.",
                  "", f"ZB-H1 idle / 1F1B idle, the worse rank: {ratio_idle:.2f}; best autoshard zero-bubble "
                      f"({ours_zb}), median of per-round ratios: / 1F1B {r['ratios'][ours_zb]:.3f}, / torch ZBV "
                      f"{r['vs_torch'][ours_zb + '/torch zbv']:.3f}, / torch interleaved ZB "
                      f"{r['vs_torch'][ours_zb + '/torch interleaved-zb']:.3f}", ""]
    m, r = max(out.items())
    f, b, w = r["fbw"]
    lines += [f"F, B, W per microbatch on a rank (ZB-H1's trace, rank 1, m = {m}): {1e3 * f:.1f}, {1e3 * b:.1f}, "
              f"{1e3 * w:.1f} ms. The simulator at these times (bubble: idle over busy, busiest rank):", "",
              "| pp | m | 1f1b | interleaved | zb-h1 | zbv | v-half | zbv, steps overlapped | chosen (no memory limit) "
              "| chosen (1F1B's memory / 2) |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    times = StageTimes(f, b, w)
    for pp in (4, 8):
        for mm in (2 * pp, 4 * pp):
            free = choose_schedule(pp=pp, microbatches=mm, times=times, activation_bytes=1.0)
            tight = choose_schedule(pp=pp, microbatches=mm, times=times, activation_bytes=1.0, limit_bytes=pp / 2 + 0.5)
            by = {c.name: c for c in free.considered}
            lines.append(f"| {pp} | {mm} | " + " | ".join(f"{100 * by[n].bubble:.1f}%" for n in
                                                          ("1f1b", "interleaved", "zb-h1", "zbv", "v-half"))
                         + f" | {100 * _overlapped_zbv(pp, mm, times):.1f}% | {free.name} | {tight.name} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--microbatches", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1, help="rounds run first and not counted")
    ap.add_argument("--model", choices=("mlp", "llama"), default="mlp")
    ap.add_argument("--vocab", type=int, default=4096, help="the Llama's vocabulary")
    ap.add_argument("--gflops", type=float, default=50.0, help="one core's matmul rate schedule=\"auto\" prices at")
    ap.add_argument("--gb-s", type=float, default=10.0, help="one core's memory rate schedule=\"auto\" prices at")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--micro-size", type=int, default=4)
    ap.add_argument("--receive-at-need", action="store_true",
                    help="also run 1F1B, ZB-H1 and ZBV with each receive posted by its own action")
    ap.add_argument("--append", action="store_true")
    ap.add_argument("--worker", action="store_true")
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    if args.layers % 4:
        sys.exit(f"zero_bubble: {args.layers} layers do not split into 4 stages")
    out = {int(k): v for k, v in run_workers(__file__, sys.argv[1:], env=ALLOCATOR).items()}
    table = _tables(out, args)
    print(table)
    if args.append:
        from results import append_result
        model = (f"MLP stack, {args.layers} blocks, hidden {args.hidden}" if args.model == "mlp" else
                 f"HF Llama, {args.layers} layers, hidden {args.hidden}, vocabulary {args.vocab}")
        shape = (f"{model}, {args.micro_size} x {args.seq} tokens per microbatch, 2 gloo processes pinned to a core "
                 f"each, SGD, {args.rounds} rounds")
        append_result("Zero-bubble schedules at pp=2 against 1F1B and torch.distributed.pipelining",
                      "python benchmarks/zero_bubble.py " + " ".join(sys.argv[1:]), shape, table)


if __name__ == "__main__":
    main()
