"""A rank program on meta tensors: the same graphs, modules and parameter shapes as `prog.rank(r)`,
no data, every collective bound to parallel/shape_comm.py's ShapeComm.

    rank = meta_rank(prog, tp_rank=1)
    gm, flat, out_spec = rank.graph_for((), meta_inputs)
    rank.collective_log                # (kind, bytes, group size, group) of every collective run so far

It runs alone in one process at any size (a 175B model's rank costs no memory) and allocates, op by
op, what the real rank allocates: planning/graph_memory.py reads a rank's memory off it. The copy
is made with `copy.deepcopy`, every tensor of the rank replaced by an empty meta tensor of its
shape, dtype and `requires_grad` first, so no weight is ever copied. It runs the graphs the program
has compiled so far (a new input signature is refused: compile it by calling the program). The
devices the graphs name (`arange(..., device=cpu)`) become meta (passes/rewrite/retarget.py), and
the ops that read values or pick a kernel by device get planning/meta_ops.py's stand-ins.
"""
from __future__ import annotations

import copy

import torch
import torch.fx as fx
from torch import nn

from autoshard.compile.rank import RankProgram
from autoshard.planning.meta_ops import on_meta
from autoshard.regions.tables import TableCache
from autoshard.errors import ShardingError
from autoshard.parallel.comm import CommHandle
from autoshard.parallel.expert_parallel import ExpertGroup
from autoshard.parallel.rng import RegionRandomOp
from autoshard.parallel.shape_comm import ShapeComm
from autoshard.passes.rewrite.retarget import retarget_device

__all__ = ["meta_rank"]


def _meta(t: torch.Tensor) -> torch.Tensor:
    empty = torch.empty_like(t, device="meta")
    if isinstance(t, nn.Parameter):
        return nn.Parameter(empty, requires_grad=t.requires_grad)
    return empty.requires_grad_(t.requires_grad) if t.is_floating_point() else empty


def _tensors(rank: RankProgram) -> list[torch.Tensor]:
    """Every tensor the rank, its graphs and their submodules hold (parameters, buffers and the
    plain tensor attributes graphs read with get_attr)."""
    roots = list(rank.modules()) + [m for gm in rank.graph_modules() for m in gm.modules()]
    out = []
    for module in roots:
        out += list(module._parameters.values()) + list(module._buffers.values())
        out += [v for v in vars(module).values() if isinstance(v, torch.Tensor)]
    return [t for t in out if isinstance(t, torch.Tensor)]


def meta_rank(prog, tp_rank: int, *, ep_rank: int | None = None, cp_rank: int | None = None,
              device: torch.device | None = None) -> RankProgram:
    """`prog.rank(tp_rank, ep_rank, cp_rank)` on meta tensors, its groups shape-only (see the module
    doc); `device`: the one it stands for, whose kernels its ops pick (planning/meta_ops.py; default:
    where the rank's weights are, the CPU for a model on meta)."""
    rank = prog.rank(tp_rank, ep_rank=ep_rank, cp_rank=cp_rank)
    tensors = _tensors(rank)
    memo: dict[int, object] = {}
    for t in tensors:
        if id(t) not in memo:
            memo[id(t)] = t if t.device.type == "meta" and not isinstance(t, nn.Parameter) else _meta(t)
    # shared, not copied: the input binding and any bound process group; no compile (it would build
    # the graph into the real program's ranks, not this copy)
    for shared in (rank._normalize, rank.expert_group):
        memo[id(shared)] = shared
    memo[id(rank._compile_for)] = _no_compile
    for cache in (m for m in rank.modules() if isinstance(m, TableCache)):
        memo[id(cache._memo)] = {}           # the real tables computed so far stay behind
    log: list[tuple[str, int, int, str]] = []      # every collective the copy runs: (kind, bytes, size, group)
    for handle, size, group in ((rank.handle, prog.tp, "tp"), (rank.cp_handle, prog.cp, "cp")):
        bound = CommHandle(handle.rank, handle.world)
        bound.comm = ShapeComm(size, log, group)
        memo[id(handle)] = bound
    copied = copy.deepcopy(rank, memo)
    copied.expert_group = None
    if ep_rank is not None:                 # its tokens exchanged evenly over a shape-only group
        group = ExpertGroup(None, ep_rank, prog.dims.ep, prog.experts_per_rank)
        group.handle.comm = ShapeComm(prog.dims.ep, log, "ep")
        copied.bind_experts(group)
    copied.collective_log = log
    devices = {t.device for t in tensors} - {torch.device("meta")}
    swaps = on_meta(device or next(iter(devices), torch.device("cpu")))
    for gm in copied.graph_modules():       # graphs name their device (arange(..., device=cpu)): meta now
        for d in devices:
            retarget_device(gm, "meta", source=d)
        _swap(gm, swaps)
    return copied


def _no_compile(named: dict, training: bool) -> None:
    shapes = {k: tuple(v.shape) for k, v in named.items() if isinstance(v, torch.Tensor)}
    raise ShardingError(f"the program has no graph for inputs of shapes {shapes} (training={training}) to read "
                        f"on meta tensors: call it once with such inputs to compile one")


def _swap(gm: fx.GraphModule, swaps: dict) -> None:
    """`swaps`' stand-ins for the functions `gm` and its nested graphs call (and the ops the rank's
    random-op modules wrap), in place."""
    for sub in gm.modules():
        if isinstance(sub, RegionRandomOp) and sub.op in swaps:
            sub.op = swaps[sub.op]
        if isinstance(sub, fx.GraphModule):
            swapped = [n for n in sub.graph.nodes if n.op == "call_function" and n.target in swaps]
            for n in swapped:
                n.target = swaps[n.target]
            if swapped:
                sub.recompile()
