"""The runtime's gradients: the one path from backward to the optimizer (Megatron-Core's
DistributedDataParallel over its ParamAndGradBuffer).

    grads = Gradients(trainable, groups, tied=..., experts=..., weight_of=..., shard=False)
    grads.begin(microbatches, scale, origin)     # MeshRuntime.train_step, before its schedule
    ...                                          # backward: hooks add each gradient into its slice
    norm = grads.end(max_norm)                   # reduce, add what earlier calls accumulated, check, clip

Parts. The trainable parameters are split into parts by the group their gradient is averaged over:
every parameter over the data-parallel group, an expert's (ep > 1) over the dp / ep ranks holding the
same experts. Each part is one flat buffer (runtime/grad_buffer.py's GradBuffer, in
`main_dtype`) cut into buckets; a parameter tied across pipeline stages (a tied embedding) is a
bucket of its own, summed over its stages before the data-parallel reduction.

Unsharded (plain data parallelism, any torch optimizer): buckets are all-reduced and each
parameter's `.grad` is its slice of the buffer after `end` (a copy in the parameter's dtype when
that is narrower). Sharded (`shard=True`, made by the distributed optimizer): buckets are
reduce-scattered, rank r of the part's group owns the r-th 1/size of every bucket, and the optimizer
steps those owned ranges (`GradPart.owned`); no `.grad` is set. With `units` (fully sharded data
parallelism: lists of parameter names, in forward order) each unit is one bucket, reduce-scattered
after every backward pass and held 1/size (grad_buffer.py's `per_pass`).

Written once here, for both: the loss normalisation's factor on the reduced gradient, the loss
scaler's inf/NaN check (fp16), the global norm (every element counted once over tp x pp x dp, with
the weights of compile/norm_weights.py) and clipping.

Frozen parameters (requires_grad=False) are in no part: their `.grad` stays None, so an optimizer
leaves them alone (weight decay included), and the distributed optimizer keeps no state for them.

Accumulation across train_step calls (a batch too large for one call): what a call adds is reduced
alone, then what earlier calls left is added to it; the single-device equivalent is several
`loss.backward()` before one `step()`. Unsharded, "what earlier calls left" is each parameter's
`.grad` at `begin` (None after `zero_grad()`); sharded, the owned ranges unless the optimizer's
`zero_grad()` ran. `max_norm` clips what has accumulated so far: pass it on the last call.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from autoshard.errors import ShardingError
from autoshard.runtime.grad_buffer import GradBuffer, ReduceRecord, plan_layout
from autoshard.runtime.loss_scale import LossScaler
from autoshard.runtime.mesh import MeshGroups, ParallelDims
from autoshard.world import Group, current

__all__ = ["GradPart", "Gradients", "global_grad_norm", "main_dtype", "refuse_changed"]

WeightOf = Callable[[str], "torch.Tensor | float"]


def main_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype main weights and gradients are kept in: at least fp32, never narrower than the
    parameters (an fp64 model keeps fp64 gradients and optimizer state)."""
    return torch.promote_types(dtype, torch.float32)


def global_grad_norm(weighted: list[tuple[torch.Tensor, torch.Tensor | float]], dims: ParallelDims,
                     replicas: int | None = None) -> torch.Tensor:
    """L2 norm of the whole model's gradient. `weighted` pairs each local gradient with the share
    of it this rank counts: 1 / (number of ranks holding it) per element or row, broadcastable.
    Data-parallel replicas hold equal gradients after the all-reduce, so the world sum is divided by
    `replicas` (default dp; 1 when each dp rank holds a disjoint shard, as a sharded buffer's)."""
    replicas = dims.data if replicas is None else replicas
    device = weighted[0][0].device if weighted else None
    total = torch.zeros((), dtype=torch.float64, device=device)
    for g, w in weighted:
        w = w.to(device) if isinstance(w, torch.Tensor) else w
        total += (g.detach().double().pow(2) * w).sum()
    current().all_reduce(total)
    return (total / replicas).sqrt()


@dataclass
class GradPart:
    """Parameters whose gradients are reduced over one group, and their flat buffer."""

    names: list[str]
    params: list[torch.nn.Parameter]
    group: Group
    size: int                      # ranks in the group
    rank: int                      # this rank's place in it
    buffer: GradBuffer

    @property
    def shards(self) -> int:
        return self.buffer.layout.shards

    @property
    def replicas(self) -> int:
        """How many ranks of the group hold each owned element (1 when sharded)."""
        return self.size // self.shards

    @functools.cached_property
    def ranges(self) -> list[tuple[int, int, int]]:
        """(index in the part, lo, hi) for each parameter range of the buffer this rank owns (the
        layout is fixed, so this is worked out once, not on every step)."""
        out = []
        for i in range(len(self.params)):
            span = self.buffer.layout.owned_piece(i, self.buffer.shard_rank)
            if span is not None:
                out.append((i, *span))
        return out

    def owned(self) -> Iterator[tuple[int, int, int]]:
        return iter(self.ranges)


class Gradients:
    """The gradients of `trainable` (name, parameter) pairs; see the module doc."""

    def __init__(self, trainable: list[tuple[str, torch.nn.Parameter]], groups: MeshGroups, *,
                 tied: dict[str, Group], experts: set[str], weight_of: WeightOf,
                 shard: bool = False, bucket_bytes: int = 25 * 2 ** 20, overlap: bool | None = None,
                 units: list[list[str]] | None = None):
        dims = groups.dims
        self.dims, self.sharded, self.weight_of = dims, shard, weight_of
        if overlap is None:      # on gloo the reduction costs the cores backward runs on (benchmarks/RESULTS.md)
            overlap = dims.data > 1 and groups.world.backend != "gloo"
        dp_rank = dims.coords(groups.rank)[1]
        spans = [([(n, p) for n, p in trainable if n not in experts], groups.dp, dims.data, dp_rank)]
        if dims.ep > 1:           # experts: over the ranks holding the same experts (data / ep of them)
            spans.append(([(n, p) for n, p in trainable if n in experts], groups.expert_dp, dims.data // dims.ep,
                          dp_rank // dims.ep))
        self.parts: list[GradPart] = []
        for named, group, size, rank in spans:
            if not named:
                continue
            names, params = [n for n, _ in named], [p for _, p in named]
            shards = size if shard else 1
            tied_here = {i: tied[n] for i, n in enumerate(names) if n in tied}
            where = {n: i for i, n in enumerate(names)}
            groups_here = None if units is None else \
                [[where[n] for n in unit if n in where] for unit in units if any(n in where for n in unit)]
            if groups_here is not None:            # a parameter no unit names: a unit of its own
                covered = {i for unit in groups_here for i in unit}
                groups_here += [[i] for i in range(len(names)) if i not in covered]
            layout = plan_layout([p.numel() for p in params], shards, max(1, bucket_bytes // 4), set(tied_here),
                                 units=groups_here)
            buffer = GradBuffer(params, layout, group, rank if shard else 0, size, tied_here, overlap,
                                dtype=main_dtype(params[0].dtype), world=groups.world, per_pass=units is not None)
            self.parts.append(GradPart(names, params, group, size, rank, buffer))
        self.base_replicas = 1 if shard else dims.data        # ranks holding each non-expert element
        self.scaler: LossScaler | None = None
        self.skipped = False           # the last end() found an inf or NaN gradient (with a scaler)
        self._pointers = self._storage()
        self._earlier: list[dict[int, torch.Tensor]] = []

    # ---- what the runtime asks ------------------------------------------------------------------
    def _storage(self) -> list[tuple[int, int]]:
        return [(id(p), p.data_ptr()) for part in self.parts for p in part.params]

    def pin(self) -> None:
        """Take the parameters' current storage as theirs (the distributed optimizer moved them)."""
        self._pointers = self._storage()

    def matches(self, trainable: list[tuple[str, torch.nn.Parameter]]) -> bool:
        """Whether these are still the parameters (same objects, same storage) this was built for."""
        mine = [(n, p) for part in self.parts for n, p in zip(part.names, part.params)]
        return (sorted(n for n, _ in mine) == sorted(n for n, _ in trainable)
                and {n: id(p) for n, p in mine} == {n: id(p) for n, p in trainable}
                and self._storage() == self._pointers)

    @property
    def loss_scale(self) -> float:
        """What the runtime multiplies the loss by before backward (1 without a loss scaler)."""
        return self.scaler.scale if self.scaler is not None else 1.0

    def records(self) -> list[tuple[int, ReduceRecord]]:
        """The last call's bucket reductions, numbered over all parts."""
        out, offset = [], 0
        for part in self.parts:
            out += [(offset + r.bucket, r) for r in part.buffer.records]
            offset += len(part.buffer.layout.buckets)
        return out

    @property
    def buckets(self) -> int:
        return sum(len(part.buffer.layout.buckets) for part in self.parts)

    # ---- one call -------------------------------------------------------------------------------
    def begin(self, microbatches: int, scale: float | torch.Tensor, origin: float,
              uses: dict[str, int] | None = None) -> None:
        """A train_step call starts (at time.time() = `origin`): keep aside what earlier calls
        accumulated, then zero the buffers; each gradient is final after `microbatches` backward
        passes of each of the `uses[name]` stage chunks reading it (default 1) and is multiplied by
        `scale` once reduced."""
        self._earlier = [self._take_earlier(part) for part in self.parts]
        uses = uses or {}
        for part in self.parts:
            part.buffer.zero()
            part.buffer.begin(microbatches, scale, origin, [uses.get(n, 1) for n in part.names])

    def _take_earlier(self, part: GradPart) -> dict[int, torch.Tensor]:
        if self.sharded:
            if not part.buffer.reduced:
                return {}
            return {i: part.buffer.local(lo, hi).clone() for i, lo, hi in part.owned()}
        return {i: p.grad.detach().reshape(-1).to(part.buffer.data.dtype, copy=True)
                for i, p in enumerate(part.params) if p.grad is not None}

    def end(self, max_norm: float | None) -> torch.Tensor | None:
        """Reduce this call's gradients, add the earlier calls' (at each owned range), check for
        inf/NaN with a loss scaler (then the step is skipped on every rank, the norm is inf), clip by
        the global norm if `max_norm` and return the norm (None without `max_norm`)."""
        for part, earlier in zip(self.parts, self._earlier):
            part.buffer.reduce()
            layout = part.buffer.layout
            for i, lo, hi in part.owned():
                if i in earlier:
                    o = layout.offsets[i]
                    part.buffer.local(lo, hi).add_(earlier[i][lo - o: hi - o] if not self.sharded else earlier[i])
        self._earlier = []
        norm = None
        self.skipped = False
        if self.scaler is not None:
            self.skipped = self.scaler.found_inf([g for *_, g in self.owned_grads()])
            self.scaler.update(self.skipped)
            if self.skipped:
                norm = torch.tensor(float("inf"))
        if not self.skipped and max_norm is not None:
            norm = self._clip(max_norm)
        if not self.sharded:
            self._publish_grads()
        return norm

    def owned_grads(self) -> Iterator[tuple[GradPart, int, int, torch.Tensor]]:
        """(part, index in the part, start in the flat buffer, flat gradient) of every range this rank owns."""
        for part in self.parts:
            for i, lo, hi in part.owned():
                yield part, i, lo, part.buffer.local(lo, hi)

    def norm(self) -> torch.Tensor:
        """The global L2 norm of the reduced gradient (every rank must call it)."""
        weighted = []
        for part, i, lo, g in self.owned_grads():
            w = self.weight_of(part.names[i])
            if isinstance(w, torch.Tensor):       # per row: spread over the parameter, then cut like the range
                start = lo - part.buffer.layout.offsets[i]
                w = w.expand(part.params[i].shape).reshape(-1)[start: start + g.numel()]
            # an element held by fewer ranks than the rest (experts) counts as often as they do
            weighted.append((g, w * (self.base_replicas // part.replicas)))
        return global_grad_norm(weighted, self.dims, replicas=self.base_replicas)

    def clip(self, max_norm: float) -> torch.Tensor:
        """Scale the owned gradients so their global norm is at most `max_norm`
        (torch.nn.utils.clip_grad_norm_'s rule); returns the norm before clipping."""
        norm = self._clip(max_norm)
        if not self.sharded:
            self._publish_grads()
        return norm

    def _clip(self, max_norm: float) -> torch.Tensor:
        norm = self.norm()
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for *_, g in self.owned_grads():
            g.mul_(coef.to(g.dtype))
        return norm

    def _publish_grads(self) -> None:
        """Unsharded: each parameter's `.grad` is its slice (or a copy in its narrower dtype)."""
        for part in self.parts:
            for i, p in enumerate(part.params):
                view = part.buffer.view(i)
                p.grad = view if view.dtype == p.dtype else view.to(p.dtype)

    def zero(self) -> None:
        """Forget the gradients (the distributed optimizer's zero_grad)."""
        for part in self.parts:
            part.buffer.zero()

    def remove_hooks(self) -> None:
        for part in self.parts:
            part.buffer.remove_hooks()


def refuse_changed(trainable: list[tuple[str, torch.nn.Parameter]], grads: Gradients) -> None:
    """A sharded buffer was laid out for the distributed optimizer's parameters: if they changed
    (replaced, moved, frozen or unfrozen) its pieces no longer describe them."""
    built = sorted(n for part in grads.parts for n in part.names)
    now = sorted(n for n, _ in trainable)
    what = "replaced or moved" if built == now else \
        f"frozen or unfrozen ({sorted(set(built) ^ set(now))[:4]})"
    raise ShardingError(f"DistributedOptimizer: parameters were {what} after the optimizer was built (set_tensors, "
                        f".to(), load_state_dict with assign, requires_grad_?); build the optimizer after moving, "
                        f"loading or freezing the runtime's parameters")
