"""Gradients in one flat buffer (fp32, or fp64 for an fp64 model), reduced over data-parallel ranks
bucket by bucket as backward finishes them (Megatron's main_grad and its overlapped reduction;
DDP's buckets).

Layout (`plan_layout`): the parameters are laid out in reverse order (backward finishes the last
layers first), packed into buckets of at most `bucket_numel` elements (a larger parameter is a
bucket of its own; a parameter tied across pipeline stages too, reduced last). Each bucket is padded
to a multiple of `shards`; shard rank r owns the r-th 1/shards of every bucket. With shards = 1
every rank owns everything (plain data parallelism: buckets are all-reduced); with shards = dp the
buckets are reduce-scattered and each rank's optimizer steps only what it owns (ZeRO-1).

`GradBuffer` keeps the buffer: a hook on each parameter adds its gradient (in any dtype) into the
parameter's slice after autograd accumulates it and frees the parameter's own `.grad`, so gradients
accumulate in fp32 (at least) across microbatches. `zero()` writes nothing: each slice is marked
stale, a stale slice's first gradient is copied in rather than added, and a slice still stale when
its bucket is reduced is zeroed then (a parameter no gradient reached). A memset of the whole buffer
before every step sat on the critical path before the first action (4.7 ms a step for a rank's 34 MB
on the 2-core CPU machine, benchmarks/RESULTS.md). With `overlap`, a bucket's reduction starts
(async) as soon as each of its parameters has had its last microbatch's gradient; `reduce()` starts
the rest and waits for all. runtime/gradients.py builds one per group of parameters. Each launch and
completion time is recorded (`records`) for the trace.

Per backward pass (`per_pass`, fully sharded data parallelism: runtime/sharded_params.py): the buffer
holds only this rank's shard of every bucket (`data` is 1/shards of the layout), as FSDP's sharded
gradients. A bucket (one unit of parameters, `plan_layout(units=...)`) gathers the gradients of one
backward pass in a temporary full-size tensor; once every parameter of the bucket has added to it, it
is reduce-scattered and the shard added into `data`, and the temporary is freed. A parameter whose
gradient did not come in a pass (an expert no token reached) only delays the reduction: what came is
summed either way. A bucket tied across pipeline stages keeps a full slot, reduced at the end as
above. `local(lo, hi)` maps an owned range of the layout onto the tensor that holds it in either mode.
"""
from __future__ import annotations

import bisect
import functools
import time
from dataclasses import dataclass, field

import torch

from autoshard.world import Group, World, current

__all__ = ["Bucket", "FlatLayout", "GradBuffer", "ReduceRecord", "plan_layout"]


@dataclass(frozen=True)
class Bucket:
    start: int                 # its range in the flat buffer; (stop - start) is a multiple of the shards
    stop: int
    params: tuple[int, ...]    # indices of the parameters laid out in it
    tied: bool = False         # a parameter tied across pipeline stages: summed over those first, reduced last

    def owned(self, shard_rank: int, shards: int) -> tuple[int, int]:
        size = (self.stop - self.start) // shards
        return self.start + shard_rank * size, self.start + (shard_rank + 1) * size


@dataclass(frozen=True)
class FlatLayout:
    offsets: tuple[int, ...]   # each parameter's first element in the flat buffer
    numels: tuple[int, ...]
    buckets: tuple[Bucket, ...]
    shards: int

    @property
    def numel(self) -> int:
        return self.buckets[-1].stop if self.buckets else 0

    def bucket_of(self, i: int) -> Bucket:
        return next(b for b in self.buckets if i in b.params)

    @functools.cached_property
    def shard_starts(self) -> tuple[int, ...]:
        """Where each bucket's 1/shards begins in one rank's shards laid end to end (the per-pass
        gradient buffer, zero=3's parameter shard)."""
        out, start = [], 0
        for b in self.buckets:
            out.append(start)
            start += (b.stop - b.start) // self.shards
        return tuple(out)

    def local_span(self, lo: int, hi: int, shard_rank: int) -> tuple[int, int]:
        """An owned range [lo, hi) of the layout, in one rank's shards laid end to end."""
        k = bisect.bisect_right([b.start for b in self.buckets], lo) - 1
        start = self.shard_starts[k] + lo - self.buckets[k].owned(shard_rank, self.shards)[0]
        return start, start + hi - lo

    def owned_piece(self, i: int, shard_rank: int) -> tuple[int, int] | None:
        """The part [lo, hi) of parameter i's flat range that shard rank `shard_rank` owns, or None."""
        a, b = self.bucket_of(i).owned(shard_rank, self.shards)
        lo, hi = max(a, self.offsets[i]), min(b, self.offsets[i] + self.numels[i])
        return (lo, hi) if lo < hi else None


def plan_layout(numels: list[int], shards: int, bucket_numel: int, tied: set[int] = frozenset(),
                units: list[list[int]] | None = None) -> FlatLayout:
    """`units` (in forward order): one bucket per unit instead of packing by `bucket_numel`."""
    offsets, buckets, pos = [0] * len(numels), [], 0
    current: list[int] = []

    def close(members: list[int], is_tied: bool = False) -> None:
        nonlocal pos
        start = pos
        for i in members:
            offsets[i], pos = pos, pos + numels[i]
        pos = start + -(-(pos - start) // shards) * shards          # pad to a multiple of the shards
        buckets.append(Bucket(start, pos, tuple(members), is_tied))

    if units is not None:
        for unit in reversed(units):
            members = [i for i in unit if i not in tied]
            if members:
                close(members)
        for i in sorted(tied, reverse=True):
            close([i], True)
        return FlatLayout(tuple(offsets), tuple(numels), tuple(buckets), shards)
    for i in reversed(range(len(numels))):
        if i in tied:
            continue
        if current and sum(numels[j] for j in current) + numels[i] > bucket_numel:
            close(current)
            current = []
        current.append(i)
    if current:
        close(current)
    for i in sorted(tied, reverse=True):
        close([i], True)
    return FlatLayout(tuple(offsets), tuple(numels), tuple(buckets), shards)


@dataclass
class ReduceRecord:
    bucket: int
    launched: float            # seconds since the step began
    done: float | None = None


@dataclass
class _Pending:
    work: object
    record: ReduceRecord
    out: torch.Tensor | None = field(default=None)
    full: torch.Tensor | None = field(default=None)     # per pass: the bucket's gradient, kept until sent


class GradBuffer:
    """Gradients of `params` (in `dtype`) laid out by `layout`, reduced over `group` (see the module doc)."""

    def __init__(self, params: list[torch.nn.Parameter], layout: FlatLayout, group: Group,
                 shard_rank: int, dp: int, tied_groups: dict[int, Group] | None = None,
                 overlap: bool = True, dtype: torch.dtype = torch.float32, world: World | None = None,
                 per_pass: bool = False):
        self.params, self.layout, self.group, self.dp = params, layout, group, dp
        self.world = current() if world is None else world
        self.shard_rank, self.overlap, self.tied_groups = shard_rank, overlap, tied_groups or {}
        self.per_pass = per_pass
        device = params[0].device if params else None
        # per pass: this rank's shard of each bucket, one after another (layout.shard_starts)
        self.data = torch.zeros(layout.numel // layout.shards if per_pass else layout.numel, dtype=dtype, device=device)
        self._temp: dict[int, torch.Tensor] = {}        # per pass: bucket -> its gradient since its last send
        self._arrived: dict[int, int] = {}
        self._bucket_index = {i: k for k, b in enumerate(layout.buckets) for i in b.params}
        self._tied_full = {k: torch.zeros(layout.buckets[k].stop - layout.buckets[k].start, dtype=dtype, device=device)
                           for k in (self._bucket_index[i] for i in tied_groups or {})} if per_pass else {}
        self.on_sent = None           # per pass: called with a bucket's index once its pass is sent
        self.records: list[ReduceRecord] = []
        self.reduced = False          # reduce() ran and zero() did not since: the data is a reduced step's
        self._seen = [0] * len(params)
        self._stale = [True] * len(params)     # the slice holds no gradient of this step yet (zero())
        self._expected: list[int] = []
        self._scale, self._origin = 1.0, 0.0
        self._launched: set[int] = set()
        self._pending: list[_Pending] = []
        self._handles = [p.register_post_accumulate_grad_hook(self._hook(i)) for i, p in enumerate(params)]

    def view(self, i: int) -> torch.Tensor:
        o, n = self.layout.offsets[i], self.layout.numels[i]
        if self.per_pass:          # tied only: its bucket's full slot, padding after it
            return self._tied_full[self._bucket_index[i]][:n].view(self.params[i].shape)
        return self.data[o: o + n].view(self.params[i].shape)

    def local(self, lo: int, hi: int) -> torch.Tensor:
        """The tensor holding the owned range [lo, hi) of the layout (a slice of `data`)."""
        if not self.per_pass:
            return self.data[lo:hi]
        start, stop = self.layout.local_span(lo, hi, self.shard_rank)
        return self.data[start:stop]

    def _add_pass(self, i: int, grad: torch.Tensor) -> None:
        """Per pass: parameter i's gradient into its bucket's temporary; the bucket is sent once each
        of its parameters added to it."""
        k = self._bucket_index[i]
        b = self.layout.buckets[k]
        if b.tied:
            slot = self.view(i)
            slot.copy_(grad) if self._stale[i] else slot.add_(grad)
            self._stale[i] = False
            return
        temp = self._temp.get(k)
        if temp is None:
            temp = self._temp[k] = torch.zeros(b.stop - b.start, dtype=self.data.dtype, device=self.data.device)
            self._arrived[k] = 0
        o = self.layout.offsets[i] - b.start
        temp[o: o + grad.numel()].add_(grad.reshape(-1))
        self._arrived[k] += 1
        if self._arrived[k] >= len(b.params):
            self._send_pass(k)

    def _scatter(self, k: int, full: torch.Tensor) -> _Pending:
        """Per pass: start reduce-scattering bucket k's full-size gradient `full` over the group."""
        self.records.append(ReduceRecord(k, time.time() - self._origin))
        if self.layout.shards == 1:
            return _Pending(None, self.records[-1], full, full)
        out = torch.empty(full.numel() // self.layout.shards, dtype=full.dtype, device=full.device)
        work = self.world.reduce_scatter(out, full, group=self.group, async_op=True)
        return _Pending(work, self.records[-1], out, full)

    def _send_pass(self, k: int) -> None:
        self._arrived.pop(k)
        self._pending.append(self._scatter(k, self._temp.pop(k)))
        while len(self._pending) > 2:          # at most two buckets' gradients in flight
            self._fold(self._pending.pop(0))
        if self.on_sent is not None:
            self.on_sent(k)

    def _fold(self, p: _Pending) -> None:
        """Per pass: wait for a sent bucket and add this rank's shard of it into `data`."""
        if p.work is not None:
            p.work.wait()
        if p.record.done is None:
            p.record.done = time.time() - self._origin
        k, n = p.record.bucket, p.out.numel()
        start = self.layout.shard_starts[k]
        self.data[start: start + n].add_(p.out)

    def _hook(self, i: int):
        def add(p: torch.nn.Parameter) -> None:
            if self.per_pass:
                self._add_pass(i, p.grad)
                p.grad = None
                return
            if self._stale[i]:
                self.view(i).copy_(p.grad)
                self._stale[i] = False
            else:
                self.view(i).add_(p.grad)
            p.grad = None
            self._poll()
            self._seen[i] += 1
            k = self._bucket_index[i]
            bucket = self.layout.buckets[k]
            if (self.overlap and self._expected and not bucket.tied and k not in self._launched
                    and all(self._seen[j] >= self._expected[j] for j in bucket.params)):
                self._launch(k)
        return add

    def begin(self, microbatches: int, scale: float | torch.Tensor, origin: float, uses: list[int] | None = None) -> None:
        """A step starts (at time.time() = `origin`, what the records count from): parameter i's
        gradient is final after `microbatches * uses[i]` backward passes (uses: how many of the rank's
        stage chunks read it, default 1: a V schedule's rank runs the first and the last stage, which
        both read a tied embedding); reduced gradients are multiplied by `scale`."""
        self._seen = [0] * len(self.params)
        self._expected = [microbatches * k for k in (uses or [1] * len(self.params))]
        self._scale, self._origin = scale, origin
        self._launched, self._pending, self.records = set(), [], []

    def _zero_stale(self, params) -> None:
        """Slices no gradient reached since zero() hold an earlier step's: zero them before reading."""
        for i in params:
            if self._stale[i]:
                self.view(i).zero_()
                self._stale[i] = False

    def _launch(self, k: int) -> None:
        self._zero_stale(self.layout.buckets[k].params)
        self._launched.add(k)
        self.records.append(ReduceRecord(k, time.time() - self._origin))
        if self.dp == 1:
            self.records[-1].done = self.records[-1].launched
            return
        b = self.layout.buckets[k]
        if self.layout.shards == 1:
            work, out = self.world.all_reduce(self.data[b.start: b.stop], group=self.group, async_op=True), None
        else:
            out = torch.empty((b.stop - b.start) // self.layout.shards, dtype=self.data.dtype, device=self.data.device)
            work = self.world.reduce_scatter(out, self.data[b.start: b.stop], group=self.group, async_op=True)
        self._pending.append(_Pending(work, self.records[-1], out))

    def _poll(self) -> None:
        """Note the completion of reductions seen finished (gloo's reduce-scatter has no future to
        call back: a completion time is the first time it is seen done, an upper bound)."""
        for p in self._pending:
            if p.record.done is None and p.work.is_completed():
                p.record.done = time.time() - self._origin

    def reduce(self) -> None:
        """Sum tied parameters over their pipeline ranks, start every reduction not started yet, wait
        for all and scale: afterwards this rank's owned ranges hold the data-parallel result."""
        if self.per_pass:
            self._reduce_passes()
            return
        for i, group in self.tied_groups.items():
            self._zero_stale((i,))
            self.world.all_reduce(self.view(i), group=group)
        for k in range(len(self.layout.buckets)):
            if k not in self._launched:
                self._launch(k)
        self._poll()
        for p in self._pending:
            p.work.wait()
            self._poll()
            if p.record.done is None:          # is_completed() may lag wait() (gloo): done by now
                p.record.done = time.time() - self._origin
            if p.out is not None:
                a, b = self.layout.buckets[p.record.bucket].owned(self.shard_rank, self.layout.shards)
                self.data[a:b].copy_(p.out)
        self._pending = []
        self.data.mul_(self._scale)
        self.reduced = True

    def _reduce_passes(self) -> None:
        for k in sorted(self._temp):                # buckets whose last pass some gradient skipped
            self._send_pass(k)
        for p in self._pending:
            self._fold(p)
        self._pending = []
        for i, group in self.tied_groups.items():   # summed over its stages, then reduce-scattered
            k = self._bucket_index[i]
            self._zero_stale((i,))
            self.world.all_reduce(self.view(i), group=group)
            self._stale[i] = True                    # the slot starts the next step afresh
            self._fold(self._scatter(k, self._tied_full[k]))
        self.data.mul_(self._scale)
        self.reduced = True

    def zero(self) -> None:
        """Forget the gradients, writing nothing (module doc): every slice stale, every `.grad` None."""
        if self.per_pass:           # 1/shards of the parameters: zeroed outright
            self.data.zero_()
            self._temp, self._arrived = {}, {}
        self.reduced = False
        self._stale = [True] * len(self.params)
        for p in self.params:
            p.grad = None

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
