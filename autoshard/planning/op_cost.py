"""What the aten ops inside a block cost: matmul and attention FLOPs (torch.utils.flop_counter's
table: mm, bmm, addmm, SDPA's kernels, convolutions, float8's _scaled_mm, kept apart; and
planning/op_flops.py's: the CPU attention kernel, grouped expert products), bytes read and written
by the others, and how many ops ran.

    with OpCost() as cost:              # on meta tensors too: only shapes are read
        ...
    cost.take()                         # -> OpWork since the last take

Per op: a matmul-like op (one the FLOP tables know) adds its FLOPs (an attention kernel's apart)
and its operands' and result's bytes, and the dispatches an opaque one makes inside itself; a view
(its result shares an input's storage, and it is not in place) adds nothing but its dispatch; any
other op adds the bytes of its tensor inputs and outputs, each storage once.
planning/graph_time.py turns the work into seconds on a hardware profile.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from autoshard.planning.op_flops import flops_of

__all__ = ["OpCost", "OpWork"]


@dataclass
class OpWork:
    matmul_flops: float = 0.0
    matmul_bytes: float = 0.0        # the matmuls' and attention kernels' operands and results
    other_bytes: float = 0.0         # every other op's tensors, read and written
    ops: int = 0
    attention_flops: float = 0.0     # fused attention kernels' (SDPA's), not in matmul_flops
    fp8_flops: float = 0.0           # float8 matmuls' (torch._scaled_mm: precision="fp8"), not in matmul_flops

    def add(self, other: "OpWork") -> "OpWork":
        return OpWork(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    def minus(self, other: "OpWork") -> "OpWork":
        return OpWork(*(getattr(self, f.name) - getattr(other, f.name) for f in fields(self)))

    def scaled(self, factor: float) -> "OpWork":
        return OpWork(*(getattr(self, f.name) * factor for f in fields(self)))


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
        counted = flops_of(func, args, kwargs, out)
        if counted is not None:
            if counted.kind == "attention":
                work.attention_flops += counted.flops
            elif func is torch.ops.aten._scaled_mm.default:
                work.fp8_flops += counted.flops
            else:
                work.matmul_flops += counted.flops
            work.matmul_bytes += _bytes(ins + outs)
            work.ops += counted.inner_ops
            return out
        in_storages = {id(t.untyped_storage()) for t in ins}
        in_place = func._schema.name.endswith("_") or any(a.alias_info is not None and a.alias_info.is_write
                                                          for a in func._schema.arguments)
        if outs and all(id(t.untyped_storage()) in in_storages for t in outs) and not in_place:
            return out                  # a view: no bytes move
        work.other_bytes += _bytes(ins) + _bytes([t for t in outs if id(t.untyped_storage()) not in in_storages])
        return out
