"""Fully sharded parameters (ZeRO-3, PyTorch's FSDP2): each data-parallel rank holds 1/dp of every
unit of parameters between uses, and the whole unit only while a forward or backward op reads it.

    flat = ShardedParams(part)     # part: a GradPart laid out one bucket per unit (gradients.py `units`)
    gathers = UnitGathers(flats)   # what the stage graphs call (passes/unit_gathers.py)

Storage. Unit k (bucket k of the layout) has a full-size tensor of its own whose storage the
parameters are views of; between uses that storage is resized to nothing (`untyped_storage().resize_`),
so the tensors, their views and what autograd saved of them stay valid objects and read the gathered
values again once the storage is refilled in place. This rank's 1/dp of every unit lives in `shard`
(one tensor, the owned ranges of the units in order): the fp32 main parameters are views of it (or
fp32 copies, for half-precision parameters), and the optimizer's step writes there; nothing is
gathered after the step, the next forward gathers each unit as it needs it.

Reading a parameter outside a step while its unit is released reads freed memory (torch does not
check): `gathered()` is the context in which every unit is whole (checkpoints, export, inspection),
and writes made to the parameters in it are kept.

When a unit is gathered (UnitGathers): forward's graph calls acquire before the unit's first op and
release after its last (resharding after forward, as FSDP2 does by default; `keep` names units left
gathered from a training forward to its backward, the last ones of the rank's forward: backward
needs them first, so releasing them only to gather them again costs two collectives for nothing
but the memory), starting the next unit's all-gather as it acquires one (prefetch); backward gathers a unit again just before the first op
whose backward reads it and starts the unit before it; a unit is released in backward once its
gradients have all been sent (grad_buffer.py's per-pass reduce-scatter), and whatever backward
gathered is released when the backward action ends (a unit with frozen parameters only, or one
whose gradients a pass skipped).
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from autoshard.runtime.flat_params import FlatParams
from autoshard.runtime.gradients import GradPart

__all__ = ["ShardedParams", "UnitGathers"]

_FREE, _COMING, _HERE = "free", "coming", "here"


class ShardedParams(FlatParams):
    """A part's parameters, 1/shards of each unit on this rank (module doc)."""

    def __init__(self, part: GradPart):
        super().__init__(part)
        self.part.buffer.on_sent = self.release

    def _place(self, device: torch.device) -> None:
        layout = self.layout
        self.units = [torch.zeros(b.stop - b.start, dtype=self.dtype, device=device) for b in layout.buckets]
        bucket_of = {i: k for k, b in enumerate(layout.buckets) for i in b.params}
        for i, p in enumerate(self.params):
            unit, o = self.units[bucket_of[i]], layout.offsets[i] - layout.buckets[bucket_of[i]].start
            unit[o: o + p.numel()].copy_(p.reshape(-1))
            p.data = unit[o: o + p.numel()].view(p.shape)
        self.shard = torch.cat([self._owned_of(k) for k in range(len(self.units))]) if self.units else \
            torch.zeros(0, dtype=self.dtype, device=device)
        self.state = [_HERE] * len(self.units)
        self._coming: dict[int, object] = {}
        for k in range(len(self.units)):
            self.release(k)

    def _owned_of(self, k: int) -> torch.Tensor:
        """This rank's range of unit k's gathered tensor."""
        b = self.layout.buckets[k]
        a, z = b.owned(self.shard_rank, self.shards)
        return self.units[k][a - b.start: z - b.start]

    def local(self, lo: int, hi: int) -> torch.Tensor:
        start, stop = self.layout.local_span(lo, hi, self.shard_rank)
        return self.shard[start:stop]

    def _shard_of(self, k: int) -> torch.Tensor:
        start = self.layout.shard_starts[k]
        return self.shard[start: start + self.units[k].numel() // self.shards]

    def param_bytes(self) -> int:
        return self.shard.numel() * self.shard.element_size()

    def gathered_bytes(self) -> int:
        """Bytes of the units whole on this rank now."""
        return sum(u.numel() * u.element_size() for u, s in zip(self.units, self.state) if s != _FREE)

    # ---- gathering ------------------------------------------------------------------------------
    def prefetch(self, k: int) -> None:
        """Start gathering unit k (nothing if it is whole or coming)."""
        if self.state[k] != _FREE:
            return
        unit = self.units[k]
        unit.untyped_storage().resize_(unit.numel() * unit.element_size())
        if self.shards == 1:
            unit.copy_(self._shard_of(k))
            self.state[k] = _HERE
            return
        self._coming[k] = self.part.buffer.world.all_gather(unit, self._shard_of(k), group=self.group, async_op=True)
        self.state[k] = _COMING

    def acquire(self, k: int) -> None:
        """Unit k whole on this rank (gathering it, or waiting for its prefetch)."""
        self.prefetch(k)
        if self.state[k] == _COMING:
            self._coming.pop(k).wait()
            self.state[k] = _HERE

    def release(self, k: int) -> None:
        """Unit k's storage freed (after its gather, if one is in flight)."""
        if self.state[k] == _FREE:
            return
        if self.state[k] == _COMING:
            self._coming.pop(k).wait()
        self.units[k].untyped_storage().resize_(0)
        self.state[k] = _FREE

    @torch.no_grad()
    def publish(self) -> None:
        """After the optimizer's step: half-precision main pieces into the shard; every unit released
        (a gathered copy would be the old values)."""
        self._copy_mains()
        for k in range(len(self.units)):
            self.release(k)

    @contextlib.contextmanager
    def gathered(self) -> Iterator[None]:
        """Every unit whole; on leaving, what was written to the parameters is kept (the owned
        ranges copied into the shard) and the units released. A collective: every rank of the
        part's group enters it together."""
        for k in range(len(self.units)):
            self.prefetch(k)
        for k in range(len(self.units)):
            self.acquire(k)
        try:
            yield
        finally:
            with torch.no_grad():
                for k in range(len(self.units)):
                    self._shard_of(k).copy_(self._owned_of(k))
                for lo, hi, main in self.pieces.values():      # half precision: the main pieces follow
                    if main.data_ptr() != self.local(lo, hi).data_ptr():
                        main.copy_(self.local(lo, hi))
                for k in range(len(self.units)):
                    self.release(k)


class _BeforeBackward(torch.autograd.Function):
    """Identity whose backward gathers units first (the op below it will read their weights)."""

    @staticmethod
    def forward(ctx, gathers: "UnitGathers", units: tuple, previous, *values):
        ctx.gathers, ctx.units, ctx.previous = gathers, units, previous
        return values if len(values) > 1 else values[0]

    @staticmethod
    def backward(ctx, *grads):
        ctx.gathers.gather_for_backward(ctx.units, ctx.previous)
        return (None, None, None, *grads)


class UnitGathers:
    """The calls the stage graphs make (passes/unit_gathers.py), over units numbered across this
    rank's ShardedParams: unit u is bucket `where[u][1]` of `where[u][0]`."""

    def __init__(self, flats: list[ShardedParams], units: list[list[str]], keep_last: int = 0):
        self.where: list[tuple[ShardedParams, int]] = []
        self.unit_of: dict[str, int] = {}
        for flat in flats:
            for k, b in enumerate(flat.layout.buckets):
                self.unit_of.update({flat.part.names[i]: len(self.where) for i in b.params})
                self.where.append((flat, k))
        self.keep = {self.unit_of[unit[0]] for unit in units[len(units) - keep_last:]} if keep_last else set()
        self.in_backward: set[int] = set()
        self.gathers = 0             # all-gathers started (the trace and the tests count them)

    def _start(self, u: int | None) -> None:
        if u is not None:
            flat, k = self.where[u]
            if flat.state[k] == _FREE:
                self.gathers += 1
            flat.prefetch(k)

    def _gather(self, units: tuple, then: int | None) -> None:
        """`units` whole, the gather of `then` (the unit read next) started first so it overlaps."""
        for u in units:
            self._start(u)
        self._start(then)
        for u in units:
            flat, k = self.where[u]
            flat.acquire(k)

    def acquire(self, u: int, following: int | None) -> None:
        self._gather((u,), following)

    def release(self, u: int) -> None:
        if u in self.keep and torch.is_grad_enabled():      # its backward comes next: keep it (`keep`)
            self.in_backward.add(u)
            return
        flat, k = self.where[u]
        flat.release(k)

    def before_backward(self, value, units: tuple, previous):
        if not torch.is_grad_enabled():
            return value
        values = list(value) if isinstance(value, (tuple, list)) else [value]
        picked = [j for j, v in enumerate(values) if isinstance(v, torch.Tensor) and v.requires_grad]
        if not picked:
            return value
        out = _BeforeBackward.apply(self, units, previous, *[values[j] for j in picked])
        out = out if isinstance(out, tuple) else (out,)
        for j, o in zip(picked, out):
            values[j] = o
        return type(value)(values) if isinstance(value, (tuple, list)) else values[0]

    def gather_for_backward(self, units: tuple, previous) -> None:
        self._gather(units, previous)
        self.in_backward.update(units)

    def end_backward(self) -> None:
        """A backward action ended: release what it gathered (or forward kept) and is still whole."""
        for u in sorted(self.in_backward):
            flat, k = self.where[u]
            flat.release(k)
        self.in_backward = set()
