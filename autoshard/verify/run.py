"""`verify_model`: compile a model's split and certify it against the model (compare.py), in the
widest float type its ops take."""
from __future__ import annotations

import copy
import time

import torch
from torch import nn

from autoshard.api import autoshard
from autoshard.errors import ShardingError
from autoshard.passes.graph_reading import module_path
from autoshard.runtime.batching import pick_loss
from autoshard.verify.batch import boundary_ids, label_classes, step_batches, verification_batch, vocab_of
from autoshard.verify.certificate import Certificate, Fallback
from autoshard.verify.compare import compare_steps
from autoshard.verify.fp8_model import to_fp8_model
from autoshard.verify.dropout import dropout_items, recompute_items, without_dropout
from autoshard.verify.perturb import perturb_weights
from autoshard.verify.runtime import local_items

__all__ = ["Split", "verify_model", "verify_program", "rows_and_seq", "TOLERANCES"]

# relative tolerance -> why: all ops in float64, or some in float32 (the model's own casts)
TOLERANCES = {torch.float64: 1e-9, torch.float32: 1e-5}
FP8_TOLERANCE = 1e-2         # precision="fp8": see verify_model
_SPLIT_KEYS = ("tp", "pp", "virtual", "dp", "ep", "cp", "microbatches", "schedule", "sequence_parallel",
               "vocab_parallel", "gather_output", "recompute", "fuse", "zero", "precision", "fp8_recipe")


def Split(**given) -> dict[str, object]:       # noqa: N802 (a record's constructor)
    """A split as autoshard() takes it; unknown names refused."""
    unknown = set(given) - set(_SPLIT_KEYS)
    if unknown:
        raise ValueError(f"unknown split option(s) {sorted(unknown)}; known: {', '.join(_SPLIT_KEYS)}")
    return {k: v for k, v in given.items() if v is not None}


def _widest(model: nn.Module, inputs: dict[str, torch.Tensor]) -> tuple[nn.Module, str]:
    """A float64 copy of `model` when its forward and backward run in float64 on the certificate's
    batch and give a finite loss, else a float32 one. (Bloom in float64 gives NaN on a left-padded
    row: its masks are filled with float32's minimum, two of them add to -inf once cast back for its
    float32 softmax. Every comparison then read "differs", the model's own NaN against itself.)"""
    wide = copy.deepcopy(model).double()
    try:
        loss = pick_loss(wide(**inputs))
        loss.backward()
        if bool(torch.isfinite(loss)):
            return wide, "float64"
        why = "float64 gives a non-finite loss on this batch: the model's own numerics"
    except (RuntimeError, NotImplementedError) as e:
        why = f"float64 refused by an op: {str(e).strip().splitlines()[0][:160]}"
    finally:
        wide.zero_grad(set_to_none=True)
    return copy.deepcopy(model).float(), f"float32 ({why})"


def _own_loss_not_finite(model: nn.Module, inputs: dict[str, torch.Tensor]) -> str | None:
    """Why nothing can be compared, when the model's own loss on the certificate's batch is NaN or
    infinite (every comparison would be NaN against NaN, and read as a difference)."""
    with torch.no_grad():
        loss = pick_loss(copy.deepcopy(model)(**inputs))
    if bool(torch.isfinite(loss)):
        return None
    return (f"the model's own loss on the certificate's batch is {loss.item()} in "
            f"{str(next(model.parameters()).dtype).removeprefix('torch.')}: there is nothing to compare against")


def _narrow_ops(prog, dtype: torch.dtype) -> list[str]:
    """Modules whose ops compute in a float type narrower than `dtype` (the model's own casts)."""
    found: list[str] = []
    for n in prog.captured_graph.nodes:
        val = n.meta.get("val")
        if isinstance(val, torch.Tensor) and val.is_floating_point() and val.dtype.itemsize < dtype.itemsize:
            where = module_path(n)
            if where not in found:
                found.append(where)
    return found


def _fallbacks(prog) -> list[Fallback]:
    out = []
    params = dict(prog.param_shapes)
    for f in prog.sharding.fallbacks:
        prefixes = tuple(m.split(" (")[0] + "." for m in f.modules)
        whole = [n for n in params if n.startswith(prefixes) and n not in prog.sharding.params]
        size = sum(torch.Size(params[n]).numel() for n in whole) * 4      # fp32 weights
        out.append(Fallback(tuple(f.modules), f.reason, f.by_design, int(size * (1 - 1 / prog.tp))))
    return out


def rows_and_seq(split: dict, seq: int | None) -> tuple[int, int]:
    """Rows for every data-parallel rank's microbatches (two each where it can: uneven -100 counts
    between them), and a length every split divides: tp (sequence parallelism), 2 x cp."""
    dp, m = split.get("dp", 1), split.get("microbatches", 1)
    rows = max(4, 2 * dp * m) if dp * m > 1 else 4
    rows = -(-rows // (dp * m)) * dp * m
    step = 2 * split.get("cp", 1) * (split.get("tp", 1) if split.get("sequence_parallel") else 1)
    seq = seq or 16
    return rows, -(-seq // step) * step


def verify_model(model: nn.Module, split: dict[str, object], *, vocab: int | None = None, seq: int | None = None,
                 twin: list[str] | None = None, notes: list[str] | None = None, runtime: bool = True,
                 distributed_optimizer: bool = False) -> Certificate:
    """Certify `split` (autoshard()'s tp, pp, ... as a dict) of `model` (left untouched): compile a
    float64 (else float32) copy with every weight moved off its initial value (verify/perturb.py),
    run it against another copy for several steps on batches with padding and without, ignored
    labels and every vocabulary shard's edge ids (verify/batch.py), in simulation and (`runtime`)
    in the runtime of every rank on a local world (verify/runtime.py; `distributed_optimizer`:
    stepping with the runtime's DistributedOptimizer), and return the certificate. `twin`: what
    was reduced, when `model` stands in for a larger one (verify/twin.py). A split's `zero` 2 or 3
    steps the runtime with the DistributedOptimizer at that stage."""
    started = time.perf_counter()
    distributed_optimizer = distributed_optimizer or split.get("zero", 1) > 1
    vocab = vocab or vocab_of(model)
    rows, seq = rows_and_seq(split, seq)
    model = copy.deepcopy(model)
    classes = label_classes(model, rows, seq, vocab)       # on the copy: a forward may update its buffers
    batch = verification_batch(model, rows, seq, vocab, classes=classes)
    perturb_weights(model)
    original = copy.deepcopy(model)          # dropout kept: its regions are checked on their own
    dropped = without_dropout(model)
    fp8 = split.get("precision") == "fp8"
    # FP8 splits too: their float8 products are summed in float64 there (parallel/fp8_linear.py's _mm)
    wide, dtype_note = _widest(model, batch.inputs)
    dtype = next(wide.parameters()).dtype
    cert = Certificate(type(model).__name__, {k: split[k] for k in _SPLIT_KEYS if k in split}, dtype_note,
                       TOLERANCES[dtype], "", batch.description, twin=list(twin or []))
    if dtype != torch.float64 and (why := _own_loss_not_finite(wide, batch.inputs)) is not None:
        cert.refusals.append(why)
        cert.seconds = time.perf_counter() - started
        return cert
    cert.runs.append("simulation (every rank in this process)")
    cert.notes = list(notes or [])
    cert.notes.append("every weight moved off its initial value first (biases not 0, norm weights not 1; "
                      "verify/perturb.py)")
    if dropped:
        cert.notes.append(f"dropout set to 0 in {dropped} module(s) for the comparison (its masks are random); its "
                          "regions are checked on their own (the dropout items)")
    reference = copy.deepcopy(wide)
    runtime_reference = copy.deepcopy(wide) if runtime else None       # the simulation steps `reference`
    pieces = split.get("dp", 1) * split.get("microbatches", 1)
    example = {k: v[: rows // pieces] for k, v in batch.inputs.items()}
    try:
        prog = autoshard(wide, example_kwargs=example, **split)
    except ShardingError as e:
        cert.refusals.append(f"the compile refused this split: {e}")
        cert.split_refused = True
        cert.seconds = time.perf_counter() - started
        return cert
    if prog.schedule_choice is not None:       # schedule="auto": the certificate names what it chose
        cert.split["schedule"] = f"auto: {prog.schedule_name}"
    if fp8:                                    # against the single-device FP8 model (verify/fp8_model.py)
        recipe, table = prog.fp8
        unswapped = to_fp8_model(reference, table, recipe)
        if runtime_reference is not None:
            to_fp8_model(runtime_reference, table, recipe)
        if unswapped:
            cert.refusals.append(f"precision fp8: {len(unswapped)} linear(s) the program runs in float8 are no "
                                 f"nn.Linear the reference can swap (first {unswapped[0]}): nothing to compare with")
        names = [name for name, why in table.items() if why is None]
        cert.notes.append(f"fp8 ({recipe}): {len(names)} of {len(table)} linears in float8, compared with the "
                          f"single-device FP8 model (the same linears as float8 ones) run on the same microbatches "
                          f"(its scales are per microbatch, as the program's): {', '.join(names)}")
        cert.notes += [f"fp8: {name} stays in the model's dtype: {why}" for name, why in table.items() if why]
    narrow = _narrow_ops(prog, dtype)
    if narrow:
        cert.tolerance = TOLERANCES[torch.float32]
        cert.tolerance_reason = (f"the model computes in a narrower float type in {len(narrow)} module(s), "
                                 f"first {narrow[0]}: float32 rounding in another summation order")
    else:
        cert.tolerance_reason = f"every op in {str(dtype).removeprefix('torch.')}: only summation order differs"
    if fp8:
        # each step from the same weights: a float8 step's difference in one gradient moves its weight,
        # the weights' amaxes move every value of a tensor, and two runs part within a few steps
        cert.tolerance = FP8_TOLERANCE
        cert.tolerance_reason = (f"{str(dtype).removeprefix('torch.')} summation order, which can move a value "
                                 "across a float8 rounding boundary: one element a whole float8 step (1/8 in e4m3). "
                                 "In float64 (the float8 products summed there too) only a value at a rounding tie "
                                 "can move, as structured weights make; in float32 any within an ulp. A few such per "
                                 "tensor stay under this, a shard scaled by its own amax misses by several times it; "
                                 "each step from the same weights on both sides")
    cert.fallbacks = _fallbacks(prog)
    steps = step_batches(wide, rows, seq, vocab, boundary_ids(prog, vocab), classes)
    cert.batch = f"{len(steps)} steps: " + "; ".join(f"{label}: {b.description}" for label, b in steps)
    ran: list = []
    if runtime:      # first: compare_steps loads its stepped weights into every rank cut, then or later
        cert.runs.append(f"the runtime, {prog.world_size} ranks on a local world in this process (schedule, "
                         f"transfers, gradient buckets, token counts"
                         + (", the distributed optimizer)" if distributed_optimizer else ")"))
        try:
            ran = local_items(prog, runtime_reference, [(label, b.inputs) for label, b in steps], cert.tolerance,
                              sharded=distributed_optimizer, by_microbatch=fp8)
        except Exception as e:      # the runtime raising is not verified; the simulation still says what differs
            cert.refusals.append(f"the runtime raised {type(e).__name__}: {str(e).strip().splitlines()[0][:200]}")
    cert.items = list(ran)
    try:
        cert.items = compare_steps(prog, reference, [(label, b.inputs) for label, b in steps], cert.tolerance,
                                   by_microbatch=fp8) + ran
        cert.items += dropout_items(original, split, example,
                                    lambda m, ex: autoshard(m, example_kwargs=ex, **split))
        cert.items += recompute_items(original, split, example, lambda m, ex, s: autoshard(m, example_kwargs=ex, **s),
                                      TOLERANCES[torch.float32])
    except Exception as e:          # a program that raises is not verified; say where
        cert.refusals.append(f"the sharded program raised {type(e).__name__}: {str(e).strip().splitlines()[0][:200]}")
    cert.seconds = time.perf_counter() - started
    return cert


def verify_program(prog, *, seq: int | None = None) -> Certificate:
    """`prog.verify()`: its split of its model, certified (the program itself is not run)."""
    model = prog.model
    if model is None or any(p.is_meta for p in model.parameters()):
        raise ShardingError("verify: this program no longer holds its model's weights (distributed() released "
                            "them, or the model is on the meta device); verify before distributed(), or run "
                            "`autoshard verify` on the model")
    if seq is None:
        lengths = [v.shape[1] for v in prog.example_inputs.values() if isinstance(v, torch.Tensor) and v.dim() >= 2]
        seq = lengths[0] if lengths else None
    return verify_model(model, prog.split(), seq=seq)
