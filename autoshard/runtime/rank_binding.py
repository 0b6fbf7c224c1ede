"""Which rank program a mesh rank runs, bound to its process groups.

A mesh rank (pp, data, tp) runs tensor-parallel rank tp's program; at ep > 1 the one cut to its
expert-parallel rank's experts, their exchanges on its expert-parallel group; at cp > 1 the graph of
its context-parallel rank (data_rank % cp), keys and values gathered on its context-parallel group.
In a local world every mesh rank runs from the same program in one process, so each takes a copy of
its own (parameters of its own: `prog.rank(..., copy=global rank + 1)`).
"""
from __future__ import annotations

from autoshard.parallel.expert_parallel import ExpertGroup
from autoshard.runtime.mesh import MeshGroups

__all__ = ["bound_rank_program"]


def bound_rank_program(prog, groups: MeshGroups, data_rank: int, tp_rank: int):
    """`prog.rank(...)` for this mesh rank, its collectives bound to `groups`."""
    dims = groups.dims
    e = dims.ep_rank(data_rank) if dims.ep > 1 else None        # ep > 1: only its experts are cut
    c = data_rank % dims.cp if dims.cp > 1 else None             # cp > 1: its tokens' graph
    copy = groups.rank + 1 if groups.world.backend == "local" else 0
    program = prog.rank(tp_rank, ep_rank=e, cp_rank=c, copy=copy).bind(groups.tp)
    if c is not None:
        program.bind_context(groups.cp)
    if e is not None:
        program.bind_experts(ExpertGroup(groups.ep, e, dims.ep, prog.experts_per_rank))
    return program
