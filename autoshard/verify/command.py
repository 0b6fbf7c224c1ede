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
import json
import os
import sys
from types import SimpleNamespace

import torch
from torch import nn

from autoshard.factory import load_factory
from autoshard.passes.recompute import RECOMPUTE_MODES
from autoshard.runtime.schedules import SCHEDULES
from autoshard.verify.certificate import Certificate
from autoshard.verify.run import Split, verify_model
from autoshard.verify.twin import twin_config

__all__ = ["main", "parser", "certify", "model_to_verify", "VerifyError", "MAX_PARAMS"]

MAX_PARAMS = 30_000_000     # above this a config's model is verified on its reduced twin (--full: never)
_SIZES = ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "max_positions")


class VerifyError(Exception):
    """A bad input to `autoshard verify`, said in one line."""


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="autoshard verify", description=__doc__.splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--model", required=True, help="a transformers model type, a Hugging Face folder, or "
                    "module:factory (as autoshard train takes it)")
    for size in _SIZES:
        ap.add_argument(f"--{size.replace('_', '-')}", type=int, default=None, help="config override")
    ap.add_argument("--factory-args", default=None, help="JSON keyword arguments for module:factory (its small "
                    "sizes, for a model too large to run here)")
    for flag, default in (("--tp", 1), ("--pp", 1), ("--virtual", 1), ("--dp", 1), ("--ep", 1), ("--cp", 1),
                          ("--microbatches", None)):
        ap.add_argument(flag, type=int, default=default)
    ap.add_argument("--schedule", choices=SCHEDULES, default=None)
    ap.add_argument("--sequence-parallel", action="store_true")
    ap.add_argument("--recompute", choices=RECOMPUTE_MODES, default=None)
    ap.add_argument("--fuse", action=argparse.BooleanOptionalAction, default=False,
                    help="fused ops (their exact torch implementations on the CPU)")
    ap.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default=None,
                    help="the training run's compute dtype; the rewrite does not depend on it, so the program is "
                         "compared in float64 (the certificate says so)")
    ap.add_argument("--plan", action="store_true", help="verify the split autoshard(world_size=--world-size) picks")
    ap.add_argument("--world-size", type=int, default=None, help="with --plan: the processes to plan for")
    ap.add_argument("--seq", type=int, default=None, help="tokens per verified sequence (default 16, rounded up "
                    "to what the split divides)")
    twin = ap.add_mutually_exclusive_group()
    twin.add_argument("--twin", action="store_true", help="verify the reduced twin even of a small model")
    twin.add_argument("--full", action="store_true", help="never reduce the model (it must fit here)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--debug", action="store_true", help="on an error, show the whole traceback")
    return ap


def _split(args) -> dict[str, object]:
    microbatches = args.microbatches or (2 * args.pp if args.pp > 1 else 1)
    return Split(tp=args.tp, pp=args.pp, virtual=args.virtual, dp=args.dp, ep=args.ep, cp=args.cp,
                 microbatches=microbatches, schedule=args.schedule, sequence_parallel=args.sequence_parallel,
                 recompute=args.recompute, fuse=args.fuse)


def _config(args):
    """The Hugging Face config `--model` names (a model type with the size options, or a folder's), or
    None for module:factory."""
    if ":" in args.model and not os.path.isdir(args.model):
        return None
    from transformers import AutoConfig
    if os.path.isdir(args.model):
        given = [f"--{s.replace('_', '-')}" for s in _SIZES if getattr(args, s) is not None]
        if given:
            raise VerifyError(f"--model {args.model} is a folder: its config fixes the sizes (drop {', '.join(given)})")
        return AutoConfig.from_pretrained(args.model)
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    if args.model not in CONFIG_MAPPING:
        raise VerifyError(f"--model {args.model}: not a transformers model type, a folder or module:factory")
    from autoshard.train.model_source import apply_sizes
    cfg = AutoConfig.for_model(args.model)
    apply_sizes(cfg, SimpleNamespace(**{s: getattr(args, s) for s in _SIZES}), False)
    return cfg


def _parameters_of(cfg) -> int:
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):
        return sum(p.numel() for p in AutoModelForCausalLM.from_config(cfg).parameters())


def model_to_verify(cfg, model: nn.Module | None, split: dict, *, twin: bool = False, full: bool = False,
                    seed: int = 0, given: str = "--model") -> tuple[nn.Module, list[str]]:
    """The model to verify, and what its twin reduced (empty: the model itself): from a Hugging Face
    `cfg` (built with random weights; its reduced twin above MAX_PARAMS or with `twin`), else
    `model` itself, which must be small enough to run here."""
    if cfg is None:
        count = sum(p.numel() for p in model.parameters())
        on_meta = any(p.is_meta for p in model.parameters())
        if (on_meta or count > MAX_PARAMS) and not full:
            raise VerifyError(f"{given} has {count / 1e6:.1f}M parameters{' on meta' if on_meta else ''}: "
                              f"give the factory its own small sizes (--factory-args: its reduced twin), or --full")
        return model, []
    from transformers import AutoModelForCausalLM
    count = _parameters_of(cfg)
    said: list[str] = []
    if twin or (count > MAX_PARAMS and not full):
        stages = split.get("pp", 1) * split.get("virtual", 1)
        cfg, said = twin_config(cfg, stages=stages, tp=split.get("tp", 1))
        said.insert(0, f"the model has {count / 1e6:.1f}M parameters; its twin {_parameters_of(cfg) / 1e6:.2f}M")
    torch.manual_seed(seed)
    try:
        return AutoModelForCausalLM.from_config(cfg), said
    except Exception as e:
        raise VerifyError(f"{given} does not build from its config: {e}") from None


def _build(args, split: dict) -> tuple[nn.Module, list[str]]:
    cfg = _config(args)
    model, said = None, []
    if cfg is None:
        factory = load_factory(args.model, "autoshard verify")
        kwargs = json.loads(args.factory_args) if args.factory_args else {}
        torch.manual_seed(args.seed)
        model = factory(**kwargs)
        if not isinstance(model, nn.Module):
            raise VerifyError(f"--model {args.model} returned a {type(model).__name__}, not an nn.Module")
        said = [f"the factory called with {kwargs} (its own small sizes)"] if kwargs else []
    model, reduced = model_to_verify(cfg, model, split, twin=args.twin, full=args.full, seed=args.seed)
    return model, said + reduced


def certify(args) -> Certificate:
    """Build the model `args` name, pick or take the split, and verify it."""
    split = _split(args)
    model, twin = _build(args, split)
    notes = []
    if args.precision in ("bf16", "fp16"):
        notes.append(f"--precision {args.precision}: the rewrite does not depend on the dtype; the program was "
                     f"compared in the widest float type, the {args.precision} arithmetic itself is not")
    if args.plan:
        split = _planned(model, args)
    return verify_model(model, split, seq=args.seq, twin=twin, notes=notes)


def _planned(model: nn.Module, args) -> dict[str, object]:
    """The split autoshard(world_size=...) picks for this model at the verified length."""
    if not args.world_size:
        raise VerifyError("--plan needs --world-size N (the processes the run will have)")
    from autoshard.api import autoshard
    from autoshard.verify.batch import verification_batch
    batch = verification_batch(model, args.world_size, args.seq or 16, getattr(model.config, "vocab_size", 128))
    prog = autoshard(model, world_size=args.world_size, global_batch=args.world_size, example_kwargs=batch.inputs)
    return Split(tp=prog.tp, pp=prog.pp, virtual=prog.virtual, dp=prog.dp, ep=prog.dims.ep,
                 microbatches=prog.microbatches, schedule=prog.schedule_name, recompute=prog.recompute,
                 fuse=prog.fuse)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        cert = certify(args)
    except (VerifyError, ValueError) as e:
        if args.debug:
            raise
        print(f"autoshard verify: {e}", file=sys.stderr)
        return 2
    print(cert.render(), flush=True)
    return 0 if cert.passed else 1
