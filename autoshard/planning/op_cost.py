"""What the aten ops inside a block cost: matmul FLOPs (torch.utils.flop_counter's table: mm, bmm,
addmm, SDPA's kernels, convolutions), bytes read and written by the others, and how many ops ran.

    with OpCost() as cost:              # on meta tensors too: only shapes are read
        ...
    cost.take()                         # -> OpWork since the last take

Per op: a matmul-like op (one the FLOP table knows) adds its FLOPs and its operands' and result's
bytes; a view (its result shares an input's storage, and it is not in place) adds nothing but its
dispatch; any other op adds the bytes of its tensor inputs and outputs, each storage once.
planning/graph_time.py turns the work into seconds on a hardware profile.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

__all__ = ["OpCost", "OpWork"]


@dataclass
class OpWork:
    matmul_flops: float = 0.0
    matmul_bytes: float = 0.0        # the matmuls' operands and results
    other_bytes: float = 0.0         # every other op's tensors, read and written
    ops: int = 0

    def add(self, other: "OpWork") -> "OpWork":
        return OpWork(self.matmul_flops + other.matmul_flops, self.matmul_bytes + other.matmul_bytes,
                      self.other_bytes + other.other_bytes, self.ops + other.ops)


def _bytes(tensors) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        seen[id(t.untyped_storage())] = t.numel() * t.element_size()
    return sum(seen.values())


class OpCost(TorchDispatchMode):
    """Counts OpWork over the ops inside the block; `take()` returns it since the last take."""

    def __init__(self):
        super().__init__()
        self._work = OpWork()

    def take(self) -> OpWork:
        work, self._work = self._work, OpWork()
        return work

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        work = self._work
        work.ops += 1
        ins = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        outs = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        count = flop_registry.get(func._overloadpacket)
        if count is not None:
            work.matmul_flops += count(*args, **kwargs, out_val=out)
            work.matmul_bytes += _bytes(ins + outs)
            return out
        in_storages = {id(t.untyped_storage()) for t in ins}
        in_place = func._schema.name.endswith("_") or any(a.alias_info is not None and a.alias_info.is_write
                                                          for a in func._schema.arguments)
        if outs and all(id(t.untyped_storage()) in in_storages for t in outs) and not in_place:
            return out                  # a view: no bytes move
        work.other_bytes += _bytes(ins) + _bytes([t for t in outs if id(t.untyped_storage()) not in in_storages])
        return out
