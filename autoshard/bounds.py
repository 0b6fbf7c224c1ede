"""Index checks that a vocabulary-parallel program needs where the single-device model gets them
for free: each rank looks up (or scores) only its own rows, so an id outside the vocabulary would
be zeroed on every rank instead of raising. One pass over the tokens, never over the vocabulary."""
from __future__ import annotations

import torch

__all__ = ["check_token_ids", "check_targets"]


def _traced_check(ok: torch.Tensor, message: str) -> None:
    """Under torch.compile a Python `if` on tensor values cannot be traced (a data-dependent guard):
    the check is an assertion op in the compiled graph instead, raising with `message` when it runs."""
    torch._assert_async(ok.all(), message)


def check_token_ids(ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """`ids`, after checking that each is in [0, vocab_size) as nn.Embedding requires."""
    if torch.compiler.is_compiling():
        in_range = (ids >= 0) & (ids < vocab_size)
        _traced_check(in_range, f"a token id is out of range for the embedding's vocabulary of {vocab_size} rows "
                                f"(ids must be in [0, {vocab_size}))")
        return ids
    if ids.numel() and ids.device.type != "meta":      # a meta tensor (shapes only) has no ids to check
        low, high = torch.stack(torch.aminmax(ids)).tolist()       # one pass, one device sync
        if low < 0 or high >= vocab_size:
            bad = low if low < 0 else high
            raise IndexError(f"token id {bad} is out of range for the embedding's vocabulary of {vocab_size} rows "
                             f"(ids must be in [0, {vocab_size}))")
    return ids


def check_targets(target: torch.Tensor, vocab_size: int, ignore_index: int) -> torch.Tensor:
    """`target`, after checking that each is in [0, vocab_size) or equal to ignore_index, as
    cross-entropy requires."""
    outside = ((target < 0) | (target >= vocab_size)) & (target != ignore_index)
    if torch.compiler.is_compiling():
        _traced_check(~outside, f"a target is out of bounds for cross-entropy over {vocab_size} classes "
                                f"(targets must be in [0, {vocab_size}) or ignore_index={ignore_index})")
        return target
    if target.numel() and target.device.type != "meta" and bool(outside.any()):                 # one device sync when all is well
        bad = target[outside]
        raise IndexError(f"target {int(bad[0])} is out of bounds for cross-entropy over {vocab_size} classes "
                         f"(targets must be in [0, {vocab_size}) or ignore_index={ignore_index})")
    return target
