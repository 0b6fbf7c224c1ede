"""The module a graph's size-only tables run in (passes/tables.py outlines them).

`TableCache(body)` runs `body` (masks, position ids, rotary tables: values that follow from sizes and
buffers alone) once per distinct inputs and returns the same tensors on later calls: every
microbatch and every pipeline stage of a rank reads one copy. Inputs match when the sizes and other
non-tensor inputs are equal and each buffer is the same tensor object at the same version (a
buffer replaced, loaded or modified in place runs the body again), under the same grad and
inference modes. Only the last inputs' tables are kept (a new shape replaces them). The returned
tensors require no gradient; the graph only reads them. Under torch.compile the body is traced
into the compiled graph like any other code (no cache).
"""
from __future__ import annotations

import torch
import torch.fx as fx
from torch import nn

__all__ = ["TableCache"]

# One set of tables is kept: the last inputs'. A mask can be large (b x s x s booleans); the eager
# model holds one per microbatch in flight (attention saves it for backward), the cache one in all.
_SLOTS = 1


def _key(value: object) -> object:
    """What identifies an input; None for an inference tensor (it has no version counter to tell
    an in-place change by: such inputs are not cached)."""
    if isinstance(value, torch.Tensor):
        return None if value.is_inference() else ("tensor", id(value), value._version)
    return (type(value).__name__, value)


class TableCache(nn.Module):
    def __init__(self, body: fx.GraphModule):
        super().__init__()
        self.body = body
        self._memo: dict[tuple, tuple[list[torch.Tensor], tuple]] = {}   # key -> (buffers held, outputs)
        self.runs = 0                    # how often the body ran (tests and inspection)

    def forward(self, *inputs):
        if torch.compiler.is_compiling():      # torch.compile traces the body into its graph
            return tuple(self.body(*inputs))
        key = (torch.is_inference_mode_enabled(), *map(_key, inputs))
        if None in key:
            self.runs += 1
            with torch.no_grad():
                return tuple(self.body(*inputs))
        hit = self._memo.get(key)
        held = [x for x in inputs if isinstance(x, torch.Tensor)]
        if hit is not None and all(a is b for a, b in zip(hit[0], held)):     # ids are of live objects
            return hit[1]
        with torch.no_grad():
            out = tuple(self.body(*inputs))
        self.runs += 1
        if len(self._memo) >= _SLOTS:
            self._memo.pop(next(iter(self._memo)))
        self._memo[key] = (held, out)
        return out
