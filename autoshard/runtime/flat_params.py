"""Parameters in one flat storage, reduced and sharded over one data-parallel group: the unit the
distributed optimizer (runtime/distributed_optimizer.py) is made of.

    part = FlatParams(params, group, size, rank, shard=True, ...)

`params` become views of `part.flat` (laid out by runtime/grad_buffer.py's plan_layout); their
gradients go to `part.grads` (a GradBuffer over `group`); `part.pieces` maps each parameter this
rank owns a piece of (by its index in `params`) to (lo, hi, main): its owned range of the flat
storage and the main tensor the optimizer steps, in `main_dtype(storage)`: fp32 for half-precision
storage, the storage's own dtype (and the range itself) for fp32 and fp64.
Without expert parallelism there is one part over the data-parallel group; with it, the experts of
a rank form a second part over the ranks that hold the same experts (`MeshGroups.expert_dp`).
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from autoshard.runtime.grad_buffer import GradBuffer, plan_layout

__all__ = ["FlatParams", "main_dtype"]


def main_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype main weights and gradients are kept in: at least fp32, never narrower than the
    parameters (an fp64 model keeps fp64 gradients and optimizer state)."""
    return torch.promote_types(dtype, torch.float32)


class FlatParams:
    def __init__(self, params: list[torch.nn.Parameter], group: dist.ProcessGroup | None, size: int, rank: int, *,
                 shard: bool, bucket_bytes: int, tied: dict[int, dist.ProcessGroup], overlap: bool):
        self.params, self.group, self.size = params, group, size
        self.shards = size if shard else 1
        self.shard_rank = rank if shard else 0
        self.layout = plan_layout([p.numel() for p in params], self.shards, max(1, bucket_bytes // 4), set(tied))
        dtype, device = params[0].dtype, params[0].device
        wide = main_dtype(dtype)                       # of the gradients and the main pieces
        self.flat = torch.zeros(self.layout.numel, dtype=dtype, device=device)     # the parameters' storage
        with torch.no_grad():
            for i, p in enumerate(params):
                o = self.layout.offsets[i]
                self.flat[o: o + p.numel()].copy_(p.reshape(-1))
                p.data = self.flat[o: o + p.numel()].view(p.shape)
        self.grads = GradBuffer(params, self.layout, group, self.shard_rank, size, tied, overlap,
                                dtype=wide)
        self.pieces: dict[int, tuple[int, int, torch.Tensor]] = {}
        for i in range(len(params)):
            span = self.layout.owned_piece(i, self.shard_rank)
            if span is not None:
                lo, hi = span
                main = self.flat[lo:hi] if dtype == wide else self.flat[lo:hi].to(wide)
                main.requires_grad_(True)
                main.grad = self.grads.data[lo:hi]
                self.pieces[i] = (lo, hi, main)

    @property
    def replicas(self) -> int:
        """How many ranks of the group hold each owned element (1 when sharded)."""
        return self.size // self.shards

    def is_storage(self, i: int, p: torch.Tensor) -> bool:
        """Whether `p` still lives where parameter i was laid out."""
        return p.data_ptr() == self.flat[self.layout.offsets[i]:].data_ptr()

    def separate_main(self) -> bool:
        return any(m.data_ptr() != self.flat[lo:hi].data_ptr() for lo, hi, m in self.pieces.values())

    @torch.no_grad()
    def publish(self) -> None:
        """After the optimizer's step: the main pieces copied into the storage (half precision), then
        the owned ranges all-gathered over the group."""
        for lo, hi, main in self.pieces.values():
            if main.data_ptr() != self.flat[lo:hi].data_ptr():
                self.flat[lo:hi].copy_(main)
        if self.shards > 1:
            for b in self.layout.buckets:
                a, z = b.owned(self.shard_rank, self.shards)
                dist.all_gather_into_tensor(self.flat[b.start: b.stop], self.flat[a:z].clone(), group=self.group)

    def whole(self, value_of: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """A flat tensor (main weights' dtype) over the layout holding `value_of(main)` at every owned
        piece, summed over the group (the owned ranges are disjoint, so that is a gather)."""
        full = torch.zeros(self.layout.numel, dtype=main_dtype(self.flat.dtype), device=self.flat.device)
        for lo, hi, main in self.pieces.values():
            full[lo:hi] = value_of(main)
        if self.shards > 1:
            dist.all_reduce(full, group=self.group)
        return full

    def view(self, full: torch.Tensor, i: int) -> torch.Tensor:
        """Parameter i's part of a flat tensor laid out like the storage, in its shape."""
        o, p = self.layout.offsets[i], self.params[i]
        return full[o: o + p.numel()].view(p.shape)
