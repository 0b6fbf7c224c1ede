"""The model `autoshard verify` checks, from its command-line arguments: a Hugging Face config (a
model type with the size options, or a folder's), built with random weights, or reduced to its twin
(twin.py) when too large to run here; or a module:factory's model. Every gloo process of
`--gloo` (gloo.py) builds it again from the same arguments: the same seeded weights."""
from __future__ import annotations

import json
import os
from types import SimpleNamespace

import torch
from torch import nn

from autoshard.factory import load_factory
from autoshard.runtime.schedules import schedule_spec
from autoshard.verify.twin import twin_config

__all__ = ["VerifyError", "MAX_PARAMS", "SIZES", "model_to_verify", "model_from_args"]

MAX_PARAMS = 30_000_000     # above this a config's model is verified on its reduced twin (--full: never)
SIZES = ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "max_positions")


class VerifyError(Exception):
    """A bad input to `autoshard verify`, said in one line."""


def _config(args):
    """The Hugging Face config `--model` names (a model type with the size options, or a folder's), or
    None for module:factory."""
    if ":" in args.model and not os.path.isdir(args.model):
        return None
    from transformers import AutoConfig
    if os.path.isdir(args.model):
        given = [f"--{s.replace('_', '-')}" for s in SIZES if getattr(args, s) is not None]
        if given:
            raise VerifyError(f"--model {args.model} is a folder: its config fixes the sizes (drop {', '.join(given)})")
        return AutoConfig.from_pretrained(args.model)
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    if args.model not in CONFIG_MAPPING:
        raise VerifyError(f"--model {args.model}: not a transformers model type, a folder or module:factory")
    from autoshard.train.model_source import apply_sizes
    cfg = AutoConfig.for_model(args.model)
    apply_sizes(cfg, SimpleNamespace(**{s: getattr(args, s) for s in SIZES}), False)
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
        schedule = split.get("schedule")      # "auto" may choose a schedule of two chunks a rank
        chunks = split.get("virtual") or (2 if schedule == "auto" else schedule_spec(schedule).chunks if schedule else 1)
        stages = split.get("pp", 1) * (chunks or 1)
        cfg, said = twin_config(cfg, stages=stages, tp=split.get("tp", 1))
        said.insert(0, f"the model has {count / 1e6:.1f}M parameters; its twin {_parameters_of(cfg) / 1e6:.2f}M")
    torch.manual_seed(seed)
    try:
        return AutoModelForCausalLM.from_config(cfg), said
    except Exception as e:
        raise VerifyError(f"{given} does not build from its config: {e}") from None


def model_from_args(args, split: dict) -> tuple[nn.Module, list[str]]:
    """The model `args` name (verify's parsed arguments, or a dict of them), and what its twin reduced."""
    if isinstance(args, dict):
        args = SimpleNamespace(**args)
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
