"""The batches a verification runs: what users pass, not what is convenient.

Token ids with a padding mask (one row padded on the left, one on the right) where the model takes
`attention_mask`, labels of -100 on the padding and on a prompt at the start of another row (so the
data-parallel slices and microbatches count different numbers of tokens: a wrong token weight
shows), and rows enough for every data-parallel rank's microbatches.

Every vocabulary shard's first and last id (`boundary_ids`, read off the compiled program) is
written into counted positions of the ids and so of the labels: an off-by-one at a shard's edge
is otherwise left to the chance that a random batch holds those ids. Several steps are compared,
each on its own batch (`step_batches`): padded, then unpadded (no attention mask: the paths a
model without padding takes, the context-parallel ring's fused pieces among them), and for a model
that takes `position_ids` packed: each row two documents whose positions restart at a point that
differs from row to row (`packed_batch`; with use_cache=False where the model takes it, under which
transformers masks each document apart).
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["VerifyBatch", "verification_batch", "input_names", "boundary_ids", "with_ids", "step_batches",
           "vocab_of", "label_classes"]

# what a verification batch holds: forward's parameters under these names
_BUILT = ("input_ids", "labels", "targets", "attention_mask", "position_ids", "use_cache")


@dataclass
class VerifyBatch:
    inputs: dict[str, torch.Tensor]        # the model's named inputs, labels included
    description: str


def input_names(model: nn.Module) -> tuple[str, str, bool]:
    """(token ids' name, labels' name, whether it takes attention_mask), from model.forward."""
    params = list(inspect.signature(model.forward).parameters)
    label = next((n for n in ("labels", "targets") if n in params), None)
    if label is None:
        raise ValueError(f"{type(model).__name__}.forward({', '.join(params)}) takes no `labels` or `targets`: "
                         "verify compares the model's own loss, its gradients and a step on them")
    ids = "input_ids" if "input_ids" in params else params[0]
    required = [n for n, p in inspect.signature(model.forward).parameters.items()
                if p.default is inspect.Parameter.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
                and n not in (ids, *_BUILT)]
    if required:
        raise ValueError(f"{type(model).__name__}.forward requires {', '.join(f'`{n}`' for n in required)}, which "
                         f"verify does not build (it builds {ids}, {label}, attention_mask, position_ids); give "
                         f"{'it' if len(required) == 1 else 'them'} a default in forward")
    return ids, label, "attention_mask" in params


def vocab_of(model: nn.Module) -> int:
    """The model's vocabulary: its config's vocab_size, else its first embedding's rows (a
    module:factory model without a config), else 128."""
    size = getattr(getattr(model, "config", None), "vocab_size", None)
    if isinstance(size, int) and size > 0:
        return size
    return next((m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)), 128)


def label_classes(model: nn.Module, rows: int, seq: int, vocab: int) -> int | None:
    """None when the model takes one label per token (a language model); its number of classes when
    it takes one per sequence (a sequence classifier: config.num_labels). A model that takes neither
    is refused, saying what it raised."""
    errors = []
    for classes in (None, getattr(getattr(model, "config", None), "num_labels", None)):
        if errors and not isinstance(classes, int):
            break
        batch = verification_batch(model, rows, seq, vocab, classes=classes)
        try:
            with torch.no_grad():
                model(**batch.inputs)
            return classes
        except Exception as e:          # the model's own complaint, reported below
            errors.append(f"{type(e).__name__}: {str(e).strip().splitlines()[0][:160]}" if str(e).strip()
                          else type(e).__name__)
    tried = "one label per token" + (" and one per sequence" if len(errors) > 1 else "")
    raise ValueError(f"{type(model).__name__} refused the verification batch ({tried}, -100 ignored, padded with an "
                     f"attention_mask): {errors[-1]}")


def verification_batch(model: nn.Module, rows: int, seq: int, vocab: int, seed: int = 0,
                       padded: bool = True, classes: int | None = None) -> VerifyBatch:
    """`rows` sequences of `seq` tokens (see the module doc). nanoGPT-style models (`targets`: the
    next tokens already) get random targets; ignored labels are -100 for every model. `padded=False`:
    no attention mask and no padding (the prompt's labels still ignored). `classes`: one label per
    sequence, of so many classes (label_classes), instead of one per token."""
    ids_name, label_name, masked = input_names(model)
    masked = masked and padded
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (rows, seq), generator=gen)
    if classes is not None:
        return _sequence_labelled(ids_name, label_name, ids, masked, classes, gen)
    labels = ids.clone() if label_name == "labels" else torch.randint(0, vocab, (rows, seq), generator=gen)
    ignore = -100           # torch's and Hugging Face's ignore index
    mask = torch.ones(rows, seq, dtype=torch.long)
    pad = max(1, seq // 4)
    notes = []
    if masked and rows >= 2:
        mask[0, :pad] = 0           # left padding
        mask[1, seq - pad:] = 0     # right padding
        labels[mask == 0] = ignore
        notes.append(f"rows 0 and 1 padded {pad} tokens (left, right)")
    prompt_row = 2 if rows > 2 else rows - 1
    prompt = seq // 2 + 1          # a prompt whose tokens are not trained on (uneven with the padding)
    labels[prompt_row, :prompt] = ignore
    notes.append(f"row {prompt_row}'s first {prompt} labels ignored")
    inputs = {ids_name: ids, label_name: labels}
    if masked:
        inputs["attention_mask"] = mask
    counted = int((labels != ignore).sum())
    return VerifyBatch(inputs, f"{rows} x {seq} tokens, {'; '.join(notes)}; {counted} of {rows * seq} labels counted")


def _sequence_labelled(ids_name: str, label_name: str, ids: torch.Tensor, masked: bool, classes: int,
                       gen: torch.Generator) -> VerifyBatch:
    """A sequence classifier's batch: one class per row; the first two rows padded (right only: a
    classifier reads its last real token) where the model takes attention_mask."""
    rows, seq = ids.shape
    inputs = {ids_name: ids, label_name: torch.randint(0, classes, (rows,), generator=gen)}
    note = f"one label per sequence ({classes} classes)"
    if masked and rows >= 2:
        pad = max(1, seq // 4)
        mask = torch.ones(rows, seq, dtype=torch.long)
        mask[:2, seq - pad:] = 0
        inputs["attention_mask"] = mask
        note += f"; rows 0 and 1 padded {pad} tokens (right)"
    return VerifyBatch(inputs, f"{rows} x {seq} tokens, {note}")


def boundary_ids(prog, vocab: int) -> list[int]:
    """The first and last id of every vocabulary shard of `prog`'s parameters with a dim of `vocab`
    rows split over tensor-parallel ranks (0 and vocab - 1 when none is split)."""
    ids = {0, vocab - 1}
    for name, use in prog.sharding.params.items():
        if tuple(prog.param_shapes[name])[use.dim] != vocab:
            continue
        for ranges in use.layout:
            for a, b in ranges:
                ids |= {i for i in (a, b - 1) if 0 <= i < vocab}
    return sorted(ids)


def with_ids(batch: VerifyBatch, ids: list[int]) -> VerifyBatch:
    """`batch` with `ids` written, in turn, into counted positions (not padding, label not ignored,
    not a row's first token, so each is an input and, shifted, a label too)."""
    inputs = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in batch.inputs.items()}
    ids_name, label_name = list(inputs)[:2]
    tokens, labels = inputs[ids_name], inputs[label_name]
    per_token = labels.shape == tokens.shape
    counted = labels != -100 if per_token else torch.ones_like(tokens, dtype=torch.bool)
    if "attention_mask" in inputs:
        counted &= inputs["attention_mask"] != 0
    counted[:, 0] = False
    spots = counted.nonzero().tolist()
    if not spots:
        return batch
    given = len(ids)
    ids = ids[:len(spots)]              # more ids than counted positions: the first ones (said below)
    stride = max(1, len(spots) // max(1, len(ids)))
    for k, token in enumerate(ids):
        r, c = spots[k * stride]
        tokens[r, c] = token
        if per_token:
            labels[r, c] = token
    short = f" ({len(ids)} of {given}: too few counted positions)" if len(ids) < given else ""
    return VerifyBatch(inputs, f"{batch.description}; shard-edge ids {_short(ids)}{short} in the ids"
                               + (" and labels" if per_token else ""))


def _short(ids: list[int]) -> str:
    return ", ".join(map(str, ids)) if len(ids) <= 8 else f"{', '.join(map(str, ids[:6]))}, ... ({len(ids)})"


def packed_batch(model: nn.Module, rows: int, seq: int, vocab: int, seed: int = 3,
                 classes: int | None = None) -> VerifyBatch | None:
    """Two documents per row, no attention mask: `position_ids` restart at seq / 2 + (row % 3) - 1
    (None when the model takes no position_ids)."""
    params = inspect.signature(model.forward).parameters
    if "position_ids" not in params or seq < 6:
        return None
    batch = verification_batch(model, rows, seq, vocab, seed=seed, padded=False, classes=classes)
    pos = torch.empty(rows, seq, dtype=torch.long)
    cuts = []
    for r in range(rows):
        cut = seq // 2 + r % 3 - 1
        pos[r] = torch.cat([torch.arange(cut), torch.arange(seq - cut)])         # [seq]: 0..cut-1, 0..
        cuts.append(cut)
    batch.inputs["position_ids"] = pos
    if "use_cache" in params:
        batch.inputs["use_cache"] = False
    return VerifyBatch(batch.inputs, f"{batch.description}; packed: position_ids restart at token "
                                     f"{', '.join(map(str, sorted(set(cuts))))} by row"
                                     + (", use_cache=False" if "use_cache" in params else ""))


def step_batches(model: nn.Module, rows: int, seq: int, vocab: int, ids: list[int],
                 classes: int | None = None) -> list[tuple[str, VerifyBatch]]:
    """The compared steps' batches (see the module doc), each with the shard-edge `ids`."""
    masked = input_names(model)[2]
    steps = [(label, verification_batch(model, rows, seq, vocab, seed=seed, padded=padded, classes=classes))
             for label, seed, padded in (("padded" if masked else "first batch", 0, True),
                                         ("unpadded" if masked else "second batch", 1, False))]
    packed = packed_batch(model, rows, seq, vocab, classes=classes)
    if packed is not None:
        steps.append(("packed", packed))
    return [(label, with_ids(b, ids)) for label, b in steps]
