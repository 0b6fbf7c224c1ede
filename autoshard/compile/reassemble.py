"""Full tensors from every rank's shards, under the model's own parameter names."""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from autoshard.parallel.comm import write_rows
from autoshard.passes.sharding.annotate import ShardingPlan

__all__ = ["assemble"]


def assemble(ranks: list[nn.Module], plan: ShardingPlan, param_shapes: dict[str, torch.Size],
             read: Callable[[nn.Parameter], torch.Tensor | None]) -> dict[str, torch.Tensor | None]:
    """`read(p)` of every rank's copy of each parameter, joined to the parameter's full shape (None
    where any rank reads None). Rows held by several ranks are equal: copied, not added."""
    out: dict[str, torch.Tensor | None] = {}
    for name, shape in param_shapes.items():
        locals_ = [read(dict(rank.named_parameters())[name]) for rank in ranks]
        use = plan.params.get(name)
        if any(t is None for t in locals_):
            out[name] = None
        elif use is None:
            out[name] = locals_[0]
        else:
            padded = list(shape)
            padded[use.dim] = use.padded or shape[use.dim]
            full = locals_[0].new_zeros(padded)
            for t, ranges in zip(locals_, use.layout):
                write_rows(full, t, use.dim, ranges)
            out[name] = full.narrow(use.dim, 0, shape[use.dim])
    return out
