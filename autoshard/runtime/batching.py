"""Cutting a global batch into data-parallel slices and microbatches, finding a model's loss, and
train_step's checks of its loss arguments."""
from __future__ import annotations

import torch
import torch.utils._pytree as pytree

from autoshard.errors import ShardingError

__all__ = ["TARGETS", "check_loss_options", "pick_loss", "refuse_num_items", "split_batch"]


TARGETS = "__autoshard_targets__"      # loss_fn's targets ride along with the inputs while splitting


def split_batch(named: dict[str, object], parts: int, what: str) -> list[dict[str, object]]:
    """Split every tensor input (also inside lists, tuples and dicts) with the batch's leading size
    into `parts` equal chunks."""
    sizes = [v.shape[0] for v in pytree.tree_leaves(named) if isinstance(v, torch.Tensor) and v.dim() > 0]
    if not sizes:
        raise ShardingError("the step's inputs hold no batched tensor to split")
    batch = sizes[0]
    if batch % parts:
        raise ShardingError(f"a batch of {batch} samples cannot be split into {what} = {parts} equal parts")
    def cut(v, i):
        return v.chunk(parts)[i] if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == batch else v
    return [pytree.tree_map(lambda v, i=i: cut(v, i), named) for i in range(parts)]


def pick_loss(outputs: object) -> torch.Tensor:
    """The loss among a model's outputs: `.loss` / ["loss"], else the one scalar tensor."""
    loss = getattr(outputs, "loss", None)
    if loss is None and isinstance(outputs, dict):
        loss = outputs.get("loss")
    if loss is None:
        scalars = [x for x in pytree.tree_leaves(outputs) if isinstance(x, torch.Tensor) and x.dim() == 0]
        if len(scalars) != 1:
            raise ShardingError(f"cannot find the loss among the model's outputs ({len(scalars)} scalar tensors); "
                                f"pass the labels so that the model returns its loss")
        loss = scalars[0]
    return loss


def check_loss_options(has_loss_fn: bool, loss_reduction: str, cp: int = 1) -> None:
    """train_step's loss arguments: a reduction it knows, "sum" only for a loss_fn, no loss_fn at cp > 1."""
    if has_loss_fn and cp > 1:
        raise ShardingError(f"cp={cp}: train_step takes the model's own loss (each rank's outputs hold only its "
                            "tokens, so a loss_fn would see part of each sequence)")
    if loss_reduction not in ("mean", "sum"):
        raise ShardingError(f"loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}")
    if loss_reduction == "sum" and not has_loss_fn:
        raise ShardingError("loss_reduction='sum' describes a loss_fn; the model's own loss is counted per token "
                            "when it is a mean cross-entropy")


def refuse_num_items(named: dict[str, object]) -> None:
    """Hugging Face's num_items_in_batch: train_step counts the global batch's tokens itself."""
    if named.get("num_items_in_batch") is not None:
        raise ShardingError("train_step averages the loss over the global batch's tokens itself; drop "
                            "num_items_in_batch (it would divide each microbatch's sum by it again)")
