"""The batch a verification runs: what users pass, not what is convenient.

Token ids with a padding mask (one row padded on the left, one on the right) where the model takes
`attention_mask`, labels of -100 on the padding and on a prompt at the start of another row (so the
data-parallel slices and microbatches count different numbers of tokens: a wrong token weight
shows), and rows enough for every data-parallel rank's microbatches.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["VerifyBatch", "verification_batch", "input_names"]


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
    return ids, label, "attention_mask" in params


def verification_batch(model: nn.Module, rows: int, seq: int, vocab: int, seed: int = 0) -> VerifyBatch:
    """`rows` sequences of `seq` tokens (see the module doc). nanoGPT-style models (`targets`: the
    next tokens already) get random targets; ignored labels are -100 for every model."""
    ids_name, label_name, masked = input_names(model)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (rows, seq), generator=gen)
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
