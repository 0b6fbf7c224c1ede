"""What the custom-op modules share: the library name and the shape/dtype helpers for broadcast
inputs (the ops broadcast and promote like the unfused torch code they replace)."""
from __future__ import annotations

import torch

from autoshard.kernels import reference as ref

LIB = "autoshard"


def sum_to(t: torch.Tensor, like: torch.Tensor | tuple | None) -> torch.Tensor | None:
    """The gradient of a broadcast input: `t` summed down to `like`'s shape. The ops broadcast as
    the unfused torch code does (the fusion pass relies on it); the CUDA kernels take the plain
    case and leave the rest to the torch implementation."""
    if like is None:
        return None
    shape, dtype = like if isinstance(like, tuple) else (like.shape, like.dtype)
    return t.sum_to_size(shape).to(dtype)


def broadcast(*ts: torch.Tensor | None) -> torch.Tensor:
    """The result of an element-wise op over `ts`: broadcast shape, promoted dtype (fake kernels)."""
    live = [t for t in ts if t is not None]
    shape = torch.broadcast_shapes(*(t.shape for t in live))
    return live[0].new_empty(shape, dtype=ref.result_dtype(*live))
