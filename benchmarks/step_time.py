"""Training-step time of autoshard against the hand-parallel baseline, side by side (torchrun).

    torchrun --standalone --nproc-per-node 2 benchmarks/step_time.py --tp 2 [--rounds 20] [--append]
    torchrun --standalone --nproc-per-node 4 benchmarks/step_time.py --tp 2 --pp 2 --microbatches 4

Both programs come from the same seeded single-device nanoGPT and run in the same gloo world:
autoshard's program (`autoshard(model, tp=t, pp=p, gather_output=False)`, loss in the graph through
its vocabulary-parallel cross-entropy; with pp its `MeshRuntime.train_step`) and
`benchmarks/hand_parallel` (Megatron's layers and, with pp, stages and schedule loop by hand).
First both train three SGD steps on the same batches and their losses must agree (relative error
<= 1e-5), so the baseline is proved to compute the same thing. Then rounds of one step each, the
order alternating per round, each step fenced by barriers; reported: median step times and the
median of the per-round ratios (autoshard / hand). Exit status 1 if the losses disagree.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from autoshard import autoshard  # noqa: E402
from autoshard.models import GPT, GPTConfig  # noqa: E402
from autoshard.testing.launch import agree, run_checker  # noqa: E402
from benchmarks.hand_parallel.gpt import ParallelGPT  # noqa: E402
from benchmarks.hand_parallel.pipeline import PipelineGPT  # noqa: E402


def _step(module, opt, idx, targets) -> float:
    opt.zero_grad(set_to_none=True)
    if hasattr(module, "train_step"):             # pipelined: the module runs forward and backward
        loss = module.train_step(idx, targets)
    else:
        _, loss = module(idx, targets)
        loss.backward()
    opt.step()
    return loss.detach().item()


def config_name(args: argparse.Namespace) -> str:
    name = f"tp={args.tp}" + (f" pp={args.pp}" if args.pp > 1 else "")
    if args.virtual_pipeline > 1:
        name += f" v={args.virtual_pipeline}"
    return name + (f" m={args.microbatches}" if args.pp > 1 or args.microbatches > 1 else "")


def _timed(module, opt, idx, targets) -> float:
    dist.barrier()
    t = time.perf_counter()
    _step(module, opt, idx, targets)
    dist.barrier()
    return time.perf_counter() - t


def main(args: argparse.Namespace) -> bool:
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != args.tp * args.pp:
        raise SystemExit(f"step_time: run with --nproc-per-node {args.tp * args.pp} (tp x pp), got world {world}")
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=args.layers, n_head=args.heads, n_embd=args.hidden, vocab_size=args.vocab,
                    block_size=args.seq)
    model = GPT(cfg)
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen),
                torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen)) for _ in range(3)]
    if args.pp == 1 and args.microbatches == 1:
        prog = autoshard(model, tp=args.tp, gather_output=False, example_inputs=batches[0])
        hand = ParallelGPT(model, rank, args.tp)
    else:
        micro = tuple(x[: args.batch // args.microbatches] for x in batches[0])
        prog = autoshard(model, tp=args.tp, pp=args.pp, virtual=args.virtual_pipeline, microbatches=args.microbatches,
                         schedule=args.schedule, gather_output=False, example_inputs=micro)
        hand = PipelineGPT(model, args.tp, args.pp, virtual=args.virtual_pipeline, microbatches=args.microbatches,
                           schedule=args.schedule)
    ours = prog.distributed()
    opt_ours = torch.optim.SGD(ours.parameters(), lr=args.lr)
    opt_hand = torch.optim.SGD(hand.parameters(), lr=args.lr)

    losses = [(_step(ours, opt_ours, *b), _step(hand, opt_hand, *b)) for b in batches]
    worst = max(abs(a - b) / abs(b) for a, b in losses)
    good = worst <= 1e-5

    times = {"autoshard": [], "hand": []}
    ratios = []
    for r in range(args.warmup + args.rounds):
        order = ("autoshard", "hand") if r % 2 == 0 else ("hand", "autoshard")
        got = {}
        for name in order:
            module, opt = (ours, opt_ours) if name == "autoshard" else (hand, opt_hand)
            got[name] = _timed(module, opt, *batches[r % 3])
        if r >= args.warmup:
            for name, t in got.items():
                times[name].append(t)
            ratios.append(got["autoshard"] / got["hand"])
    result = {"config": config_name(args), "layers": args.layers, "hidden": args.hidden, "heads": args.heads,
              "vocab": args.vocab, "seq": args.seq, "batch": args.batch, "rounds": args.rounds,
              "losses": [[round(a, 6), round(b, 6)] for a, b in losses], "loss_rel": worst, "autoshard_ms": 1e3 * statistics.median(times["autoshard"]),
              "hand_ms": 1e3 * statistics.median(times["hand"]), "ratio": statistics.median(ratios)}
    ok = agree(result, good)
    if rank == 0 and ok and args.append:
        from results import append_result
        from tabulate import tabulate
        table = tabulate([(config_name(args), f"{result['autoshard_ms']:.1f}", f"{result['hand_ms']:.1f}",
                           f"{result['ratio']:.3f}", f"{worst:.1e}")],
                         headers=("config", "autoshard ms", "hand ms", "ratio (median of rounds)", "loss rel"),
                         tablefmt="github")
        append_result("Step time vs hand-parallel",
                      " ".join(["torchrun", "--nproc-per-node", str(world)] + sys.argv),
                      f"gloo, {args.rounds} rounds, {args.schedule}", table)
    return ok


def cli() -> None:
    """The command line (also run as a job of the test suite's launches: tests/launches.py)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # --virtual-pipeline, not --virtual: torchrun reads any prefix of its --virtual-local-rank as its own
    for flag, default in (("--tp", 2), ("--pp", 1), ("--virtual-pipeline", 1), ("--microbatches", 1), ("--layers", 4), ("--hidden", 256), ("--heads", 8), ("--vocab", 4096),
                          ("--seq", 128), ("--batch", 4), ("--rounds", 20), ("--warmup", 3)):
        ap.add_argument(flag, type=int, default=default)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--schedule", default="1f1b", choices=("gpipe", "1f1b", "interleaved"))
    ap.add_argument("--append", action="store_true")
    args = ap.parse_args()
    run_checker(lambda: main(args))


if __name__ == "__main__":
    cli()
