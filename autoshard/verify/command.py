"""`autoshard verify`: certify a split of a model before training it.

    autoshard verify --model llama --layers 4 --hidden 128 --heads 8 --kv-heads 2 --tp 2 --pp 2
    autoshard verify --model llama --tp 2 --pp 2              # the 7B-shaped default config: its reduced twin
    autoshard verify --model pkg.module:make_model --tp 2 --factory-args '{"layers": 2}'

The model is named as `autoshard train` names it (a transformers model type built from its config
with the size options, a local Hugging Face folder's config, or module:factory), the split too.
Weights are random (seeded): what is certified is the program, which does not depend on their
values. Exit status 0 only when the certificate's every comparison holds.
"""
from __future__ import annotations

import argparse
import sys
import time

from torch import nn

from autoshard.api import autoshard
from autoshard.passes.recompute import RECOMPUTE_MODES
from autoshard.runtime.mesh import ParallelDims
from autoshard.runtime.schedules import SCHEDULES
from autoshard.train.cluster import rendezvous_args
from autoshard.train.options import add_rendezvous_flags, rendezvous_problem
from autoshard.verify.batch import verification_batch, vocab_of
from autoshard.verify.certificate import Certificate
from autoshard.verify.gloo import run_in_processes
from autoshard.verify.run import Split, verify_model
from autoshard.verify.source import SIZES, VerifyError, model_from_args

__all__ = ["main", "parser", "certify"]


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="autoshard verify", description=__doc__.splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--model", required=True, help="a transformers model type, a Hugging Face folder, or "
                    "module:factory (as autoshard train takes it)")
    for size in SIZES:
        ap.add_argument(f"--{size.replace('_', '-')}", type=int, default=None, help="config override")
    ap.add_argument("--factory-args", default=None, help="JSON keyword arguments for module:factory (its small "
                    "sizes, for a model too large to run here)")
    for flag, default in (("--tp", 1), ("--pp", 1), ("--dp", 1), ("--ep", 1), ("--cp", 1)):
        ap.add_argument(flag, type=int, default=default)
    ap.add_argument("--virtual", type=int, default=None, help="pipeline chunks per rank (default 1; 2 for the V "
                    "schedules zbv and v-half)")
    ap.add_argument("--microbatches", type=int, default=None, help="per data-parallel rank (default 2 x pp)")
    ap.add_argument("--schedule", choices=(*SCHEDULES, "auto"), default=None,
                    help="a pipeline schedule, or auto: the fastest predicted from the graph (autoshard(schedule=))")
    ap.add_argument("--sequence-parallel", action="store_true")
    ap.add_argument("--recompute", choices=RECOMPUTE_MODES, default=None)
    ap.add_argument("--fuse", action=argparse.BooleanOptionalAction, default=False,
                    help="fused ops (their exact torch implementations on the CPU)")
    ap.add_argument("--precision", choices=["fp32", "bf16", "fp16", "fp8"], default=None,
                    help="the training run's compute dtype; the rewrite does not depend on it, so the program is "
                         "compared in float64 (the certificate says so); fp8: the split's linears in float8, "
                         "compared with the single-device FP8 model in float32")
    ap.add_argument("--fp8-recipe", choices=["tensorwise", "rowwise"], default=None,
                    help="with --precision fp8: one scale per tensor (default) or per row")
    ap.add_argument("--plan", action="store_true", help="verify the split autoshard(world_size=--world-size) picks")
    ap.add_argument("--world-size", type=int, default=None, help="with --plan: the processes to plan for")
    ap.add_argument("--seq", type=int, default=None, help="tokens per verified sequence (default 16, rounded up "
                    "to what the split divides)")
    twin = ap.add_mutually_exclusive_group()
    twin.add_argument("--twin", action="store_true", help="verify the reduced twin even of a small model")
    twin.add_argument("--full", action="store_true", help="never reduce the model (it must fit here)")
    ap.add_argument("--gloo", action="store_true", help="also run the runtime's steps in real processes (torchrun, "
                    "gloo), as verify runs them on a local world in this process by default")
    add_rendezvous_flags(ap.add_argument_group("--gloo on more than one machine (torchrun's rendezvous; each "
                                               "machine runs this command)"), restarts=False)
    ap.add_argument("--distributed-optimizer", action="store_true", help="the runtime steps with its "
                    "DistributedOptimizer (AdamW's state sharded over data-parallel ranks), as autoshard train does")
    ap.add_argument("--zero", type=int, choices=(1, 2, 3), default=None,
                    help="the DistributedOptimizer's stage the runtime steps with: 2 divides the gradients too, 3 the "
                         "parameters too (fully sharded); 2 and 3 imply --distributed-optimizer")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--debug", action="store_true", help="on an error, show the whole traceback")
    return ap


def _split(args) -> dict[str, object]:
    microbatches = args.microbatches or (2 * args.pp if args.pp > 1 else 1)
    fp8 = args.precision == "fp8"
    return Split(tp=args.tp, pp=args.pp, virtual=args.virtual, dp=args.dp, ep=args.ep, cp=args.cp,
                 microbatches=microbatches, schedule=args.schedule, sequence_parallel=args.sequence_parallel,
                 recompute=args.recompute, fuse=args.fuse, zero=args.zero, precision="fp8" if fp8 else None,
                 fp8_recipe=(args.fp8_recipe or "tensorwise") if fp8 else None)


def certify(args) -> Certificate:
    """Build the model `args` name, pick or take the split, and verify it."""
    if args.plan and ((args.tp, args.pp, args.dp, args.ep, args.cp) != (1,) * 5 or args.microbatches or args.virtual):
        raise VerifyError("--plan verifies the split the planner chooses; give none of --tp --pp --virtual --dp --ep "
                          "--cp --microbatches with it")
    if args.nnodes is not None:
        if not args.gloo:
            raise VerifyError(f"--nnodes {args.nnodes}: machines run the certificate's runtime steps with --gloo; "
                              f"without it verify runs in this process alone")
        if (problem := rendezvous_problem(args)) is not None:
            raise VerifyError(problem)
    split = _split(args)
    if args.nnodes and not args.plan:
        _machines_divide(split, args.nnodes)
    args.distributed_optimizer = args.distributed_optimizer or (args.zero or 1) > 1
    model, twin = model_from_args(args, split)
    notes = []
    if args.fp8_recipe and args.precision != "fp8":
        raise VerifyError(f"--fp8-recipe {args.fp8_recipe}: a recipe for --precision fp8")
    if args.precision in ("bf16", "fp16"):
        notes.append(f"--precision {args.precision}: the rewrite does not depend on the dtype; the program was "
                     f"compared in the widest float type, the {args.precision} arithmetic itself is not")
    if args.plan:
        split = _planned(model, args)
    cert = verify_model(model, split, seq=args.seq, twin=twin, notes=notes, distributed_optimizer=args.distributed_optimizer)
    if args.gloo and not cert.refusals:
        model_args = {k: getattr(args, k) for k in ("model", *SIZES, "factory_args", "twin", "full", "seed")}
        spec = {"model_args": model_args, "split": split, "seq": args.seq, "tolerance": cert.tolerance,
                "dtype": "float64" if cert.dtype == "float64" else "float32",
                "distributed_optimizer": args.distributed_optimizer}
        nodes = args.nnodes or 1
        world = _machines_divide(split, nodes)
        rendezvous = None if args.nnodes is None else \
            rendezvous_args(nodes, args.rdzv_endpoint, args.rdzv_id, 0, run_id=args.rdzv_id, conf=args.rdzv_conf)
        started = time.perf_counter()
        items, refused = run_in_processes(spec, world // nodes, rendezvous=rendezvous)
        cert.seconds += time.perf_counter() - started
        cert.items += items
        cert.runs.append(f"gloo, {world} processes" + (f" on {nodes} machines" if nodes > 1 else "") +
                         " (the runtime: schedule, transfers, gradient reductions"
                         + (", the distributed optimizer)" if args.distributed_optimizer else ")"))
        if refused:
            cert.refusals.append(refused)
    return cert


def _machines_divide(split: dict, nodes: int) -> int:
    """The split's processes, which `nodes` machines must share evenly (each runs as many)."""
    world = ParallelDims(*(split.get(k, 1) for k in ("tp", "pp", "dp", "ep", "cp"))).world_size
    if world % nodes:
        raise VerifyError(f"--nnodes {nodes}: the split's {world} processes do not divide evenly over {nodes} "
                          f"machines")
    return world


def _planned(model: nn.Module, args) -> dict[str, object]:
    """The split autoshard(world_size=...) picks for this model at the verified length."""
    if not args.world_size:
        raise VerifyError("--plan needs --world-size N (the processes the run will have)")
    batch = verification_batch(model, args.world_size, args.seq or 16, vocab_of(model))
    prog = autoshard(model, world_size=args.world_size, global_batch=args.world_size, example_kwargs=batch.inputs)
    return prog.split()


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        cert = certify(args)
    except (VerifyError, ValueError) as e:
        if args.debug:
            raise
        print(f"autoshard verify: {e}", file=sys.stderr)
        return 2
    if cert.split_refused:          # the split cannot be built for this model: say why in one line
        print(f"autoshard verify: {cert.refusals[0]}", file=sys.stderr)
        return 2
    print(cert.render(), flush=True)
    return 0 if cert.passed else 1
