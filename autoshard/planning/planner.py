"""Choosing tp, pp, dp, interleaving and microbatch size from the cost model.

    >>> from autoshard.planning.planner import ModelShape, plan
    >>> best = plan(ModelShape(hidden=10240, layers=60, heads=80, vocab=51200, seq=2048),
    ...             gpus=1024, global_batch=1792)[0]      # PTD-P Table 1's 76.1B run
    >>> best.tp, best.pp
    (8, 4)

The planner enumerates every legal split of the GPUs (tensor-parallel inside a node and dividing
the heads, pipeline no deeper than the layers, data-parallel dividing the batch) and every
activation-recompute mode the runtime has (none, selective, full; or the one asked for), for a
mixture-of-experts model every expert-parallel size dividing dp and the experts, lets
`costmodel.estimate` pick each one's microbatch and interleaving, drops what does not fit in
memory, and ranks the rest by predicted iteration time. `Estimate.explain()` says why a plan fits
(its busiest rank's memory by cause). `hardware` may be a preset's name or a `Hardware`, such as
the measured `cpu` profile (autoshard.cpu_profile.measure_cpu).
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch.nn as nn

from autoshard.errors import require_positive_int
from autoshard.planning.costmodel import RECOMPUTE, Estimate, estimate
from autoshard.planning.hardware import Hardware, get_hardware
from autoshard.planning.moe_cost import MoEShape, moe_shape
from autoshard.planning.schedule_choice import CANDIDATES

__all__ = ["ModelShape", "shape_of", "plan", "explain"]


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    layers: int
    heads: int
    vocab: int
    seq: int


# Config attribute names, one row per field, in the order tried (Hugging Face, then nanoGPT).
_CONFIG_NAMES: dict[str, tuple[str, ...]] = {
    "hidden": ("hidden_size", "n_embd", "d_model"),
    "layers": ("num_hidden_layers", "n_layer", "num_layers"),
    "heads": ("num_attention_heads", "n_head", "num_heads"),
    "vocab": ("vocab_size",),
    "seq": ("max_position_embeddings", "n_positions", "block_size", "max_seq_len"),
}


def _config_name(config, field: str) -> str | None:
    """The first of `field`'s config attributes that holds an int (the one shape_of reads), or None."""
    return next((a for a in _CONFIG_NAMES[field] if isinstance(getattr(config, a, None), int)), None)


def shape_of(model_or_shape: nn.Module | ModelShape | dict) -> ModelShape:
    """The transformer shape of a model (read from its `config`), a ModelShape, or a dict of its fields."""
    if isinstance(model_or_shape, ModelShape):
        return model_or_shape
    if isinstance(model_or_shape, dict):
        return ModelShape(**model_or_shape)
    config = getattr(model_or_shape, "config", None)
    if config is None:
        raise ValueError(f"cannot read the shape of {type(model_or_shape).__name__}: it has no `config`; "
                         "pass autoshard.planning.planner.ModelShape(hidden=, layers=, heads=, vocab=, seq=)")
    found, missing = {}, []
    for name, aliases in _CONFIG_NAMES.items():
        attr = _config_name(config, name)
        (missing.append(f"{name} (one of {', '.join(aliases)})") if attr is None
         else found.__setitem__(name, getattr(config, attr)))
    if missing:
        raise ValueError(f"{type(model_or_shape).__name__}.config lacks {'; '.join(missing)}; "
                         "pass autoshard.planning.planner.ModelShape instead")
    return ModelShape(**found)


def _splits(shape: ModelShape, gpus: int, global_batch: int, hw: Hardware, seq: int, context: bool):
    """(tp, pp, dp, cp) splits of `gpus`; cp > 1 only with `context` and a sequence of 2 * cp pieces."""
    for tp in range(1, min(gpus, hw.gpus_per_node) + 1):
        if gpus % tp or shape.heads % tp or shape.hidden % shape.heads:
            continue
        for pp in range(1, min(gpus // tp, shape.layers) + 1):
            if (gpus // tp) % pp:
                continue
            rest = gpus // (tp * pp)
            for cp in range(1, rest + 1) if context else (1,):
                if rest % cp == 0 and seq % (2 * cp) == 0 and global_batch % (rest // cp) == 0:
                    yield tp, pp, rest // cp, cp


def _expert_splits(dp: int, moe: MoEShape | None, sequence_parallel: bool) -> list[int]:
    """ep sizes to try: dividing dp and the experts (not with sequence parallelism: the runtime refuses both)."""
    if moe is None or sequence_parallel:
        return [1]
    return [e for e in range(1, dp + 1) if dp % e == 0 and moe.experts % e == 0]


def _optimizer_modes(distributed_optimizer: bool | None, data: int, zero: int | None = None
                     ) -> tuple[tuple[bool, int], ...]:
    """(divide the optimizer's state, zero stage) pairs to try: as given, or each where there is a
    data axis to divide over (with one replica it changes nothing). A plain optimizer is zero=1 with
    nothing divided; `zero` given keeps to it (and implies the distributed optimizer when > 1)."""
    if data == 1:
        return ((bool(distributed_optimizer), 1),)
    if zero is not None and zero > 1:
        return ((True, zero),)
    modes = {False: ((False, 1),), True: ((True, 1), (True, 3)), None: ((False, 1), (True, 1), (True, 3))}
    return tuple(m for m in modes[distributed_optimizer] if zero is None or m[1] == zero)


def plan(model_or_shape: nn.Module | ModelShape | dict, *, gpus: int, global_batch: int,
         hardware: str | Hardware = "a100-80gb", seq: int | None = None, recompute: str | None = None,
         sequence_parallel: bool = False, top: int | None = None,
         distributed_optimizer: bool | None = False, moe: MoEShape | None = None,
         context_parallel: bool = False, attention: str = "math",
         schedules: tuple[str, ...] = CANDIDATES, zero: int | None = None,
         precision: str = "bf16") -> list[Estimate]:
    """Configurations that fit memory, fastest first (at most `top` of them). recompute: one mode
    ("none", "selective", "full"), or None to search all three. distributed_optimizer: AdamW's state
    and main parameters divided over dp (autoshard.runtime.distributed_optimizer), in memory and in
    the optimizer's time; None searches both where dp x cp > 1 (the estimate's
    `distributed_optimizer` says which: it is the optimizer you build, not part of the program);
    with it (True or None) the fully sharded zero=3 is weighed too (the estimate's `zero` says
    which), unless `zero` is given (2 and 3 imply the distributed optimizer).
    moe: the model's experts (read from a model's config when not given); the planner then also
    searches ep (dividing dp and the experts; ep=1 with sequence parallelism). context_parallel:
    also search cp (each rank seq / cp tokens; not with sequence parallelism or experts, which the
    runtime does not build with cp yet). Off by default: at short sequences cp splits come within
    a percent of the best and crowd the ranking (benchmarks/RESULTS.md). attention: "math" or
    "flash" (the attention core's memory: costmodel.estimate). schedules: the pipeline schedules
    weighed for each split (planning/schedule_choice.py): by default 1F1B, interleaved and the
    zero-bubble ZB-H1, ZBV and V-Half; each estimate's `explain()` lists them at its microbatch.
    seq: the tokens per sequence the run trains at; without it a model's plan is for its config's
    maximum positions, with a warning (a ModelShape carries its own seq). precision: "fp8" prices
    the layers' linears at the hardware's FP8 rate with their casts (costmodel.estimate)."""
    require_positive_int("gpus", gpus)
    require_positive_int("global_batch", global_batch)
    shape = shape_of(model_or_shape)
    hw = get_hardware(hardware)
    modes = RECOMPUTE if recompute is None else (recompute,)
    if moe is None and isinstance(model_or_shape, nn.Module):
        moe = moe_shape(model_or_shape)
    if seq is None and isinstance(model_or_shape, nn.Module):
        warnings.warn(f"plan: no seq= given, so the plan is for {shape.seq} tokens per sequence, "
                      f"{type(model_or_shape).__name__}.config's maximum ({_config_name(model_or_shape.config, 'seq')}); "
                      "pass seq= the length you train at", stacklevel=2)
    seq = seq or shape.seq
    context = context_parallel and not sequence_parallel and moe is None
    found = [estimate(hidden=shape.hidden, layers=shape.layers, heads=shape.heads, vocab=shape.vocab,
                      seq=seq, tp=tp, pp=pp, dp=dp, global_batch=global_batch, hardware=hw,
                      recompute=mode, sequence_parallel=sequence_parallel,
                      distributed_optimizer=sharded, moe=moe, ep=ep, cp=cp, attention=attention,
                      schedules=schedules, zero=stage, precision=precision)
             for tp, pp, dp, cp in _splits(shape, gpus, global_batch, hw, seq, context)
             for ep in _expert_splits(dp, moe, sequence_parallel) for mode in modes
             for sharded, stage in _optimizer_modes(distributed_optimizer, dp * cp, zero)]
    fitting = sorted((e for e in found if e.fits), key=lambda e: e.seconds_per_iteration)
    if not fitting:
        least = min(found, key=lambda e: e.memory_gib_per_gpu, default=None)
        raise ValueError(f"no split of {gpus} GPUs fits {shape} in {hw.memory_gib} GiB per GPU"
                         + (f"; the least memory is {least.memory_gib_per_gpu:.1f} GiB at tp={least.tp} "
                            f"pp={least.pp}" if least else " (no legal split: check heads and batch)"))
    return fitting[:top] if top else fitting


def explain(plans: list[Estimate], top: int = 3) -> str:
    """The first `top` plans, each with its time breakdown and what it loses against the best."""
    best = plans[0]
    lines = []
    for i, e in enumerate(plans[:top]):
        line = f"{i + 1}. {e.explain()}"
        if i:
            slower = 100 * (e.seconds_per_iteration / best.seconds_per_iteration - 1)
            cause = max(e.breakdown, key=lambda k: e.breakdown[k] - best.breakdown.get(k, 0.0))
            line += f"\n   {slower:.1f}% slower than 1., mostly in {cause}"
        lines.append(line)
    return "\n".join(lines)
