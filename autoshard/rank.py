"""One rank's program: an nn.Module holding exactly that rank's parameter shards and its graph(s).

Parameters are registered under the model's own names (`named_parameters()` reads like the original
model's), each a slice of the original tensor. Graphs are kept one per input signature; they read
the same Parameter objects, so training one rank module trains all its graphs.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn

from .capture import Signature, autocast_state, fetch_attr
from .collectives import (
    CommHandle,
    Communicator,
    CopyToTensorParallelRegion,
    ProcessGroupComm,
    ReduceFromTensorParallelRegion,
    SyncReplicatedShard,
)
from .passes.rewrite import CrossEntropySpec, RandomOpSpec, SequenceSpec, SyncSpec
from .rng import RegionRandomOp, RNGTracker
from .sequence_parallel import (
    GatherFromSequenceParallelRegion,
    ReduceScatterToSequenceParallelRegion,
)
from .vocab_parallel import (
    GatherFromTensorParallelRegion,
    VocabParallelCrossEntropy,
    VocabShard,
)

__all__ = ["RankProgram", "slice_layout", "assign_attr", "has_attr"]


def slice_layout(t: torch.Tensor, dim: int, ranges) -> torch.Tensor:
    """This rank's part of `t`: the listed index ranges along `dim`, concatenated. Indices past
    t's size (a padded vocabulary) are zeros."""
    n = t.shape[dim]
    parts = []
    for a, b in ranges:
        if a < n:
            parts.append(t.narrow(dim, a, min(b, n) - a))
        if b > max(a, n):
            shape = list(t.shape)
            shape[dim] = b - max(a, n)
            parts.append(t.new_zeros(shape))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


def assign_attr(root: nn.Module, path: str, value: object) -> None:
    """Set `root.<path>` (dotted), creating empty parent modules; tensors become parameters or buffers."""
    *mods, leaf = path.split(".")
    for m in mods:
        if not hasattr(root, m):
            root.add_module(m, nn.Module())
        root = getattr(root, m)
    if isinstance(value, nn.Parameter):
        root.register_parameter(leaf, value)
    elif isinstance(value, torch.Tensor):
        root._parameters.pop(leaf, None)
        root.register_buffer(leaf, value)
    else:
        setattr(root, leaf, value)


class RankProgram(nn.Module):
    """Rank `rank` of `world_size`: call it like the original model (inside a torchrun job)."""

    pp_rank = dp_rank = 0       # mesh coordinates, as a PipelineRuntime has them

    @property
    def tp_rank(self) -> int:
        return self.rank

    def __init__(self, rank: int, world_size: int, params: dict[str, nn.Parameter],
                 normalize: Callable[[tuple, dict], dict]):
        super().__init__()
        self.rank, self.world_size = rank, world_size
        self.handle = CommHandle(rank, world_size)
        self.rng = RNGTracker(rank)
        for name, p in params.items():
            assign_attr(self, name, p)
        self.f = CopyToTensorParallelRegion(self.handle)
        self.g = ReduceFromTensorParallelRegion(self.handle)
        object.__setattr__(self, "_graphs", [])      # (Signature, GraphModule, out_spec); not submodules
        object.__setattr__(self, "_normalize", normalize)
        object.__setattr__(self, "_compile_for", None)

    # ---- graphs ------------------------------------------------------------------------------
    def add_graph(self, sig: Signature, graph: fx.Graph, attrs: dict[str, object], specs, out_spec) -> fx.GraphModule:
        for name, value in attrs.items():
            if not has_attr(self, name):
                assign_attr(self, name, value)
        for spec in specs:
            if not hasattr(self, spec.module):
                self.add_module(spec.module, self._collective(spec))
        gm = fx.GraphModule(self, graph, class_name=f"Rank{self.rank}Program")
        self._graphs.append((sig, gm, out_spec))
        return gm

    def graph_modules(self) -> list[fx.GraphModule]:
        return [gm for _, gm, _ in self._graphs]

    def set_tensors(self, values: dict[str, torch.Tensor]) -> None:
        """Replace parameters or buffers by name, here and in every graph (materialization swaps
        meta tensors for real ones; a Parameter passed in is used as is, so callers can share it)."""
        for name, value in values.items():
            for root in [self] + [gm for _, gm, _ in self._graphs]:
                if has_attr(root, name):
                    assign_attr(root, name, value)

    def _collective(self, spec) -> nn.Module:
        if isinstance(spec, SyncSpec):
            return SyncReplicatedShard(self.handle, spec.dim, spec.size, spec.ranges)
        if isinstance(spec, SequenceSpec):
            if spec.kind == "reduce_scatter":
                return ReduceScatterToSequenceParallelRegion(self.handle, spec.dim, spec.outer)
            return GatherFromSequenceParallelRegion(self.handle, spec.dim, spec.outer, spec.kind == "all_gather")
        if isinstance(spec, RandomOpSpec):
            return RegionRandomOp(self.rng, spec.op, spec.region)
        if isinstance(spec, CrossEntropySpec):
            shard = VocabShard(spec.start, spec.count, spec.valid)
            return VocabParallelCrossEntropy(self.handle, shard, spec.ignore_index, spec.reduction, spec.vocab_size)
        return GatherFromTensorParallelRegion(self.handle, spec.dim, spec.size, spec.valid, spec.ranges, spec.chunks)

    def graph_for(self, args: tuple, kwargs: dict):
        """The graph for a call in this module's mode (`train()` / `eval()`) and autocast state,
        compiled (in that mode and state) if new."""
        named = self._normalize(args, kwargs)
        flat, spec = pytree.tree_flatten(((), named))
        autocast = autocast_state()
        for sig, gm, out_spec in self._graphs:
            if sig.matches(flat, spec, self.training, autocast):
                return gm, flat, out_spec
        if self._compile_for is None:
            raise ValueError(f"rank {self.rank} has no graph for these inputs and cannot compile one")
        self._compile_for(named, self.training)
        return self.graph_for(args, kwargs)

    @property
    def graph_module(self) -> fx.GraphModule:
        """The graph compiled for the example inputs."""
        return self._graphs[0][1]

    @property
    def code(self) -> str:
        return "\n".join(gm.code for _, gm, _ in self._graphs)

    # ---- running -----------------------------------------------------------------------------
    def bind(self, comm: Communicator | torch.distributed.ProcessGroup | None) -> "RankProgram":
        """Run collectives on `comm` (a Communicator, or a torch.distributed group; None: WORLD)."""
        self.handle.comm = comm if hasattr(comm, "all_reduce") else ProcessGroupComm(comm)
        return self

    def forward(self, *args, **kwargs):
        gm, flat, out_spec = self.graph_for(args, kwargs)
        return pytree.tree_unflatten(list(gm(*flat)), out_spec)


def has_attr(root: nn.Module, path: str) -> bool:
    """Whether `root.<path>` (dotted) exists."""
    try:
        fetch_attr(root, path)
        return True
    except AttributeError:
        return False
