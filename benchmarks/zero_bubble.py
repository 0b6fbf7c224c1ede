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
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from autoshard import autoshard  # noqa: E402
from autoshard.planning.schedule_choice import StageTimes, choose_schedule, stage_times  # noqa: E402
from autoshard.runtime.schedules import make_schedule, overlapped_bubble  # noqa: E402
from self_launch import run_workers  # noqa: E402

# One thread per process; glibc keeps freed memory for reuse instead of unmapping large tensors and
# faulting fresh pages in for the next (profiled at m = 8: by default the split schedules' backward
# matmuls ran 7% slower than 1F1B's, with this 3-5%). Every program, ours and torch's, runs so.
ALLOCATOR = {"OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": str(32 * 2 ** 20),
             "MALLOC_TRIM_THRESHOLD_": str(8 * 2 ** 30), "MALLOC_TOP_PAD_": str(256 * 2 ** 20)}
OURS = ("1f1b", "zb-h1", "zbv", "v-half")
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


def build(args: argparse.Namespace) -> Stack:
    torch.manual_seed(0)
    return Stack(args.layers, args.hidden)


class Ours:
    def __init__(self, name: str, args: argparse.Namespace, m: int):
        example = torch.zeros(args.micro_size, args.seq, args.hidden)
        schedule = name.removesuffix(AT_NEED)
        self.runtime = autoshard(build(args), pp=2, microbatches=m, schedule=schedule,
                                 example_inputs=(example,)).distributed()
        self.runtime.transfer.ahead = not name.endswith(AT_NEED)     # runtime/p2p.py's receiving ahead

    def parameters(self):
        return self.runtime.parameters()

    def step(self, x: torch.Tensor) -> float:
        return float(self.runtime.train_step(x))

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

    def __init__(self, kind: str, args: argparse.Namespace, m: int):
        from torch.distributed.pipelining import PipelineStage, ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble
        rank, model = dist.get_rank(), build(args)
        per = args.layers // 4
        mine = [rank, 3 - rank] if kind == "torch zbv" else [rank, rank + 2]
        self.modules = [nn.Sequential(*([model.norm] if s == 0 else []), *model.blocks[s * per:(s + 1) * per])
                        for s in mine]
        stages = [PipelineStage(mod, s, 4, torch.device("cpu")) for mod, s in zip(self.modules, mine)]
        make = ScheduleZBVZeroBubble if kind == "torch zbv" else ScheduleInterleavedZeroBubble
        self.schedule = make(stages, m, loss_fn=_square_mean)
        self.first, self.last = 0 in mine, 3 in mine

    def parameters(self):
        return [p for mod in self.modules for p in mod.parameters()]

    def step(self, x: torch.Tensor) -> float:
        losses: list[torch.Tensor] = []
        target = torch.zeros(x.shape[0])
        args = (x,) if self.first else ()
        self.schedule.step(*args, target=target if self.last else None, losses=losses)
        loss = torch.stack(losses).mean().detach() if self.last else torch.zeros(())
        dist.all_reduce(loss)               # the one rank holding the last stage has it
        return float(loss)


def _timed(program, opt, x: torch.Tensor) -> tuple[float, float]:
    dist.barrier()
    t0 = time.perf_counter()
    loss = program.step(x)
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
        batch = m * args.micro_size
        gen = torch.Generator().manual_seed(1)
        xs = [torch.randn(batch, args.seq, args.hidden, generator=gen) for _ in range(2)]
        ours = _ours(args)
        programs = {name: Ours(name, args, m) for name in ours}
        programs.update({name: Theirs(name, args, m) for name in THEIRS})
        opts = {name: torch.optim.SGD(p.parameters(), lr=1e-3) for name, p in programs.items()}
        first = {name: _timed(p, opts[name], xs[0])[1] for name, p in programs.items()}
        agree = max(abs(v - first["1f1b"]) / abs(first["1f1b"]) for v in first.values())
        names = list(programs)
        wall = {n: [] for n in names}
        idle = {n: [] for n in ours}
        for r in range(args.warmup + args.rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                seconds = _timed(programs[name], opts[name], xs[r % 2])[0]
                step_idle = programs[name].idle() if name in ours else None
                if r >= args.warmup:
                    wall[name].append(seconds)
                    if name in ours:
                        idle[name].append(step_idle)
        fbw = stage_times(programs["zb-h1"].runtime.records) if rank == 1 else None
        gathered: list = [None] * 2
        dist.all_gather_object(gathered, {"idle": {n: statistics.median(v) for n, v in idle.items()},
                                          "fbw": fbw and [fbw.forward, fbw.backward_input, fbw.backward_weight]})
        out[m] = {"loss_agree": agree, "wall": {n: statistics.median(v) for n, v in wall.items()},
                  "ratios": {n: statistics.median(a / b for a, b in zip(wall[n], wall["1f1b"])) for n in names},
                  "vs_torch": {f"{n}/{t}": statistics.median(a / b for a, b in zip(wall[n], wall[t]))
                               for n in ours for t in THEIRS},
                  "idle": [g["idle"] for g in gathered], "fbw": gathered[1]["fbw"]}
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
        lines += ["", f"ZB-H1 idle / 1F1B idle, the worse rank: {ratio_idle:.2f}; best autoshard zero-bubble "
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
        shape = (f"MLP stack, {args.layers} blocks, hidden {args.hidden}, {args.micro_size} x {args.seq} tokens "
                 f"per microbatch, 2 gloo processes pinned to a core each, SGD")
        append_result("Zero-bubble schedules at pp=2 against 1F1B and torch.distributed.pipelining",
                      "python benchmarks/zero_bubble.py " + " ".join(sys.argv[1:]), shape, table)


if __name__ == "__main__":
    main()
