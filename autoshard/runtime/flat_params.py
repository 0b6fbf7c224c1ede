"""A gradient part's parameters in one flat storage, with the main pieces an optimizer steps: the
unit the distributed optimizer (runtime/distributed_optimizer.py) is made of.

    flat = FlatParams(part)           # part: a sharded GradPart of the runtime's Gradients

The part's parameters become views of `flat.flat`, laid out like its gradient buffer (so a rank's
owned ranges of both line up); `flat.pieces` maps each parameter this rank owns a range of (by its
index in the part) to (lo, hi, main): the range and the main tensor the optimizer steps, in
`main_dtype(storage)`: fp32 for half-precision storage, the storage's own range for fp32 and fp64.
Each main tensor's `.grad` is the same range of the gradient buffer.
"""
from __future__ import annotations

from typing import Callable

import torch

from autoshard.runtime.gradients import GradPart, main_dtype
from autoshard.world import current

__all__ = ["FlatParams"]


class FlatParams:
    def __init__(self, part: GradPart):
        self.part, self.params, self.layout = part, part.params, part.buffer.layout
        self.group, self.shards, self.shard_rank = part.group, part.shards, part.buffer.shard_rank
        self.dtype, device = self.params[0].dtype, self.params[0].device
        wide = main_dtype(self.dtype)
        with torch.no_grad():
            self._place(device)
        self.pieces: dict[int, tuple[int, int, torch.Tensor]] = {}
        for i, lo, hi in part.owned():
            main = self.local(lo, hi) if self.dtype == wide else self.local(lo, hi).to(wide)
            main.requires_grad_(True)
            main.grad = part.buffer.local(lo, hi)
            self.pieces[i] = (lo, hi, main)

    def _place(self, device: torch.device) -> None:
        """Move the parameters into their flat storage, as views of it."""
        self.flat = torch.zeros(self.layout.numel, dtype=self.dtype, device=device)     # the parameters' storage
        for i, p in enumerate(self.params):
            o = self.layout.offsets[i]
            self.flat[o: o + p.numel()].copy_(p.reshape(-1))
            p.data = self.flat[o: o + p.numel()].view(p.shape)

    def local(self, lo: int, hi: int) -> torch.Tensor:
        """The owned range [lo, hi) of the layout in this rank's parameter storage."""
        return self.flat[lo:hi]

    def param_bytes(self) -> int:
        """Bytes this rank holds for the parameters between steps (padding included)."""
        return self.flat.numel() * self.flat.element_size()

    @property
    def replicas(self) -> int:
        return self.part.replicas

    def separate_main(self) -> bool:
        return any(m.data_ptr() != self.local(lo, hi).data_ptr() for lo, hi, m in self.pieces.values())

    @torch.no_grad()
    def publish(self) -> None:
        """After the optimizer's step: the main pieces copied into the storage (half precision), then
        the owned ranges all-gathered over the group."""
        self._copy_mains()
        if self.shards > 1:
            for b in self.layout.buckets:
                a, z = b.owned(self.shard_rank, self.shards)
                current().all_gather(self.flat[b.start: b.stop], self.flat[a:z].clone(), group=self.group)

    def _copy_mains(self) -> None:
        for lo, hi, main in self.pieces.values():
            if main.data_ptr() != self.local(lo, hi).data_ptr():
                self.local(lo, hi).copy_(main)

    def whole(self, value_of: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """A flat tensor (main weights' dtype) over the layout holding `value_of(main)` at every owned
        piece, summed over the group (the owned ranges are disjoint, so that is a gather)."""
        full = torch.zeros(self.layout.numel, dtype=main_dtype(self.dtype), device=self.params[0].device)
        for lo, hi, main in self.pieces.values():
            full[lo:hi] = value_of(main)
        if self.shards > 1:
            current().all_reduce(full, group=self.group)
        return full

    def view(self, full: torch.Tensor, i: int) -> torch.Tensor:
        """Parameter i's part of a flat tensor laid out like the storage, in its shape."""
        o, p = self.layout.offsets[i], self.params[i]
        return full[o: o + p.numel()].view(p.shape)
