"""The `autoshard` command line.

    autoshard inspect pkg.module:make_model --tp 2 [--pp 2 --virtual 1 --microbatches 2] [--code] [--rank R]
    autoshard schedule --pp 4 --virtual 2 --microbatches 8 [--schedule interleaved] [--out docs/picture]
    autoshard plan (pkg.module:make_model | --hidden H --layers L --heads A --vocab V --seq S)
                   --gpus N --global-batch B [--hardware a100-80gb] [--top 5]
    autoshard verify --model llama --tp 2 --pp 2 [--gloo]      (autoshard/verify/command.py)
    autoshard train ...                                        (autoshard/train/options.py)

`inspect` builds the model with the factory (any callable returning an nn.Module; Hugging Face and
nanoGPT-style models need no example inputs, others take --batch/--seq token ids), compiles it, and
prints the per-rank table; --code adds tensor-parallel rank R's program, or with pp > 1 each of its
stages. `schedule` prints a schedule's unit-cost timeline and bubble, and with --out writes its
Chrome trace (.json) and picture (.png). `plan` ranks every legal tp x pp x dp split of N GPUs by
the cost model's predicted iteration time (each with its best microbatch and interleaving) and
explains the first three. Progress goes to stderr.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

from autoshard.api import autoshard
from autoshard.errors import CaptureError
from autoshard.factory import load_factory, one_line_errors
from autoshard.passes.recompute import RECOMPUTE_MODES
from autoshard.planning.hardware import PRESETS
from autoshard.planning.planner import ModelShape, explain, plan, shape_of
from autoshard.runtime.schedules import (SCHEDULES, bubble_fraction, check, make_schedule, overlapped_bubble, peak_in_flight,
                                         schedule_spec, stage_owner)
from autoshard.runtime.trace import export_trace, records_of, text_timeline

__all__ = ["main"]


def _progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _factory(spec: str):
    return load_factory(spec, "autoshard inspect")


def inspect(args: argparse.Namespace) -> None:
    t0 = time.perf_counter()
    _progress(f"building {args.factory} ...")
    model = _factory(args.factory)()
    example = None
    if args.seq:
        vocab = getattr(getattr(model, "config", None), "vocab_size", 2)
        example = (torch.randint(0, vocab, (args.batch, args.seq)),)
    _progress(f"compiling {type(model).__name__} at tp={args.tp}, pp={args.pp}, virtual={args.virtual} ...")
    try:
        prog = autoshard(model, tp=args.tp, pp=args.pp, virtual=args.virtual, microbatches=args.microbatches,
                         example_inputs=example)
    except CaptureError as e:
        if example is not None or "cannot infer example inputs" not in str(e):
            raise
        raise SystemExit(f"autoshard inspect: {str(e).split(';')[0]}; give it token ids with --seq S "
                         f"(and --batch B), or a factory for a model that takes them") from None
    print(prog)
    if args.code:
        _progress(f"rewriting rank {args.rank} ...")
        if args.pp > 1:
            for s, gm in enumerate(prog.stage_modules(args.rank)):
                print(f"\n# ---- tensor-parallel rank {args.rank}, stage {s} "
                      f"(pipeline rank {stage_owner(s, args.pp, prog.placement)[0]}) ----")
                print(gm.code)
        else:
            print(f"\n# ---- rank {args.rank} ----")
            print(prog.rank(args.rank).code)
    _progress(f"done in {time.perf_counter() - t0:.1f} s")


def schedule(args: argparse.Namespace) -> None:
    """One unit of time per chunk for each of F, B (input gradients) and W (weight gradients): a
    schedule without W actions runs B and W as one backward of 2 units."""
    spec = schedule_spec(args.schedule)
    v = spec.chunks or args.virtual        # only the interleaved schedule takes any number of chunks
    steps = make_schedule(args.schedule, args.pp, v, args.microbatches)
    timeline = check(steps, v, args.microbatches, weight_cost=1.0, placement=spec.placement)
    print(text_timeline(timeline))
    formula = {"zb-h1": ("(p - 1) / (3 m)", (args.pp - 1) / (3 * args.microbatches)),
               "zbv": ("the last rank's wait, (p - 1) / (6 m)", (args.pp - 1) / (6 * args.microbatches))}.get(
        args.schedule, ("(p - 1) / (v m)", (args.pp - 1) / (v * args.microbatches)))
    overlapped = overlapped_bubble(steps, v, args.microbatches, weight_cost=1.0, placement=spec.placement)
    print(f"bubble: {bubble_fraction(timeline):.4f} of ideal time ({formula[0]} = {formula[1]:.4f}); "
          f"with steps overlapped (optimizer post-validation, not run here): {overlapped:.4f}; "
          f"peak activations held: {max(peak_in_flight(steps))} chunk(s) of 1/{v} of a rank's layers")
    if args.out:
        export_trace(records_of(timeline, 1e-3), args.out)
        _progress(f"wrote {args.out}.json and {args.out}.png")


def plan_verb(args: argparse.Namespace) -> None:
    from tabulate import tabulate
    fields = ("hidden", "layers", "heads", "vocab", "seq")
    if args.factory:
        _progress(f"building {args.factory} to read its shape ...")
        source = _factory(args.factory)()
    else:
        missing = [f"--{f}" for f in fields if getattr(args, f) is None]
        if missing:
            raise SystemExit(f"autoshard plan: give module:factory or all of {', '.join(missing)}")
        source = ModelShape(**{f: getattr(args, f) for f in fields})
    seq = args.seq
    if seq is None:        # a factory's model: its config's maximum positions, said rather than assumed
        seq = shape_of(source).seq
        _progress(f"no --seq: planning for {seq} tokens per sequence, the config's maximum")
    _progress(f"estimating every split of {args.gpus} GPUs on {args.hardware} ...")
    try:
        plans = plan(source, gpus=args.gpus, global_batch=args.global_batch, hardware=args.hardware,
                     seq=seq, distributed_optimizer={"no": False, "yes": True, "search": None}[args.distributed_optimizer], recompute=args.recompute, sequence_parallel=args.sequence_parallel,
                     context_parallel=args.cp)
    except ValueError as e:
        raise SystemExit(f"autoshard plan: {e}") from None
    moe = any(e.moe is not None for e in plans)       # the ep column only for mixture-of-experts models
    context = any(e.cp > 1 for e in plans[:args.top])     # the cp column only when a shown plan has cp
    rows = [(i + 1, e.tp, e.pp, e.dp, *([e.ep] if moe else []), *([e.cp] if context else []), e.microbatch, e.virtual,
             "yes" if e.sequence_parallel else "no", e.recompute, "yes" if e.distributed_optimizer else "no",
             f"{e.tflops_per_gpu:.1f}", f"{e.percent_of_peak:.1f}",
             f"{e.seconds_per_iteration:.3g}", f"{e.memory_gib_per_gpu:.1f}") for i, e in enumerate(plans[:args.top])]
    print(tabulate(rows, headers=("#", "tp", "pp", "dp", *(["ep"] if moe else []), *(["cp"] if context else []),
                                  "microbatch", "v", "sp", "recompute", "dist-opt",
                                  "TFLOP/s/GPU", "% peak", "s/iter", "GiB/GPU")))
    print(f"\n{len(plans)} configurations fit; the first three:\n{explain(plans)}")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["train"]:                  # its own command line (autoshard/train/options.py)
        from autoshard.train import main as train
        return train(argv[1:])
    if argv[:1] == ["verify"]:                 # its own command line (autoshard/verify/command.py)
        from autoshard.verify.command import main as verify
        sys.exit(verify(argv[1:]))
    ap = argparse.ArgumentParser(prog="autoshard", description="Megatron-style sharding as a compiler pass.")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", help="on an error, show the whole traceback")
    verbs = ap.add_subparsers(dest="verb", required=True)
    ins = verbs.add_parser("inspect", parents=[common], help="shard a model and print the per-rank table (and code)")
    ins.add_argument("factory", help="module:callable returning the model")
    for flag, default in (("--tp", 1), ("--pp", 1), ("--virtual", 1), ("--microbatches", 1), ("--rank", 0),
                          ("--batch", 2), ("--seq", 0)):
        ins.add_argument(flag, type=int, default=default)
    ins.add_argument("--code", action="store_true", help="print the rank's rewritten program")
    ins.set_defaults(run=inspect)
    sch = verbs.add_parser("schedule", parents=[common], help="draw a pipeline schedule")
    sch.add_argument("--pp", type=int, default=4)
    sch.add_argument("--virtual", type=int, default=2, help="pipeline chunks per rank (interleaving; zbv and v-half run 2)")
    sch.add_argument("--microbatches", type=int, default=8)
    sch.add_argument("--schedule", choices=SCHEDULES, default="interleaved")
    sch.add_argument("--out", default=None, help="write OUT.json (Chrome trace) and OUT.png")
    sch.set_defaults(run=schedule)
    pl = verbs.add_parser("plan", parents=[common], help="rank tp x pp x dp splits by the cost model's predicted speed")
    pl.add_argument("factory", nargs="?", default=None, help="module:callable returning the model (or give the shape)")
    for flag in ("--hidden", "--layers", "--heads", "--vocab", "--seq"):
        pl.add_argument(flag, type=int, default=None)
    pl.add_argument("--gpus", type=int, required=True)
    pl.add_argument("--global-batch", type=int, required=True, help="sequences per iteration")
    pl.add_argument("--hardware", choices=sorted(PRESETS), default="a100-80gb")
    pl.add_argument("--recompute", choices=RECOMPUTE_MODES, default=None,
                    help="activation recomputation (default: the planner tries all three)")
    pl.add_argument("--sequence-parallel", action="store_true")
    pl.add_argument("--cp", action="store_true", help="also search context parallelism (each rank seq / cp tokens)")
    pl.add_argument("--distributed-optimizer", choices=("no", "yes", "search"), default="no",
                    help="AdamW's state divided over the data-parallel ranks: never (default), always, or where "
                         "it is faster or fits")
    pl.add_argument("--top", type=int, default=5)
    pl.set_defaults(run=plan_verb)
    verbs.add_parser("train", help="train a model on text, sharded (autoshard train --help)", add_help=False)
    verbs.add_parser("verify", help="certify a split against the single-device model (autoshard verify --help)",
                     add_help=False)
    args = ap.parse_args(argv)
    with one_line_errors(f"autoshard {args.verb}", args.debug):
        args.run(args)


if __name__ == "__main__":
    main()
