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

from autoshard.compile.capture import Signature, autocast_state
from autoshard.regions.experts_call import ExpertsCall
from autoshard.regions.registry import REGION_MODULES, build_region_module
from autoshard.module_paths import assign_attr, has_attr
from autoshard.parallel.comm import CommHandle, Communicator, GroupComm
from autoshard.world import Group
from autoshard.parallel.registry import ModuleSpec, build_module
from autoshard.parallel.rng import RNGTracker
from autoshard.parallel.tensor_parallel import CopyToTensorParallelRegion, ReduceFromTensorParallelRegion

__all__ = ["RankProgram", "slice_layout"]


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


class RankProgram(nn.Module):
    """Tensor-parallel rank `rank` of `tp`: call it like the original model (inside a torchrun job)."""

    pp_rank = dp_rank = 0       # mesh coordinates, as a MeshRuntime has them

    @property
    def tp_rank(self) -> int:
        return self.rank

    def __init__(self, rank: int, tp: int, params: dict[str, nn.Parameter],
                 normalize: Callable[[tuple, dict], dict],
                 compile_for: Callable[[dict[str, object], bool], object] | None = None,
                 cp_rank: int = 0, cp: int = 1):
        super().__init__()
        self.rank, self.tp, self.cp_rank, self.cp = rank, tp, cp_rank, cp
        self.handle = CommHandle(rank, tp)
        self.cp_handle = CommHandle(cp_rank, cp)       # context parallelism's group (cp > 1)
        self.rng = RNGTracker(rank, cp_rank=cp_rank)
        for name, p in params.items():
            assign_attr(self, name, p)
        self.f = CopyToTensorParallelRegion(self.handle)
        self.g = ReduceFromTensorParallelRegion(self.handle)
        # plain attributes (nn.Module registers only modules, parameters and tensors): the graphs are
        # (Signature, GraphModule, out_spec), kept out of the submodules so they are not listed twice
        self._graphs: list[tuple[Signature, fx.GraphModule, object]] = []
        self._normalize = normalize
        self._compile_for = compile_for     # the program's compile: (named inputs, training) -> new graph
        self.expert_group = None            # expert parallelism's group, once bound (bind_experts)
        self.expert_params: set[str] = set()    # the program's expert parameters, where this rank holds only its own
        self.expert_templates: dict[str, nn.Module] = {}     # path -> experts module (set by the program)

    # ---- graphs ------------------------------------------------------------------------------
    def add_graph(self, sig: Signature, graph: fx.Graph, attrs: dict[str, object], specs: list[ModuleSpec], out_spec,
                  regions: list = ()) -> fx.GraphModule:
        """A graph for `sig`, with the modules it calls: the collectives of `specs`
        (parallel/registry.py) and the outlined `regions` (regions/registry.py)."""
        for name, value in attrs.items():
            if not has_attr(self, name):
                assign_attr(self, name, value)
        for spec in specs:
            if not hasattr(self, spec.module):
                self.add_module(spec.module, build_module(spec, self))
        order = list(REGION_MODULES)           # experts calls before the recomputed layers that call them
        for region in sorted(regions, key=lambda r: order.index(type(r)) if type(r) in order else len(order)):
            self.add_module(region.name, build_region_module(region, self))
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

    def bind_inputs(self, args: tuple, kwargs: dict) -> dict[str, object]:
        """A call's arguments by the model's parameter names (`**kwargs` under their own)."""
        return self._normalize(args, kwargs)

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
    def bind(self, comm: Communicator | Group) -> "RankProgram":
        """Run collectives on `comm` (a Communicator, or a group of this rank's world; None: all of it)."""
        self.handle.comm = comm if hasattr(comm, "all_reduce") else GroupComm(comm)
        return self

    def bind_context(self, group: Group) -> None:
        """Gather keys and values over `group`, this rank's context-parallel group (cp > 1)."""
        self.cp_handle.comm = GroupComm(group)

    def expert_calls(self) -> list[ExpertsCall]:
        return [m for m in self.modules() if isinstance(m, ExpertsCall)]

    def bind_experts(self, group) -> None:
        """Run every experts call (and those of graphs compiled later) expert-parallel on `group`
        (autoshard.parallel.expert_parallel.ExpertGroup): the program built this rank with that
        group's experts (`prog.rank(r, ep_rank)`); the runtime binds its process group."""
        self.expert_group = group
        for call in self.expert_calls():
            call.bind(group)

    def forward(self, *args, **kwargs):
        gm, flat, out_spec = self.graph_for(args, kwargs)
        return pytree.tree_unflatten(list(gm(*flat)), out_spec)
