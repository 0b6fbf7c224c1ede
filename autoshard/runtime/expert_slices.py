"""Expert parallelism at run time: this rank keeps only its experts (runtime/mesh.py draws the groups).

    names = cut_experts(program, dims, dp_rank, groups.ep)

Each expert parameter (stacked [experts, ...], as the experts calls of the rank program read them)
is replaced by this rank's consecutive slice of experts, and every experts call is bound to the
expert-parallel group (autoshard/parallel/expert_parallel.py), so the program exchanges tokens
instead of running every expert.
"""
from __future__ import annotations

from torch import nn

from autoshard.errors import ShardingError
from autoshard.parallel.expert_parallel import ExpertGroup
from autoshard.runtime.mesh import ParallelDims

__all__ = ["cut_experts"]


def cut_experts(program, dims: ParallelDims, dp_rank: int, group) -> set[str]:
    """With ep > 1: this rank's experts' slices replace the full expert parameters, and every experts
    call is bound to the expert-parallel group. Returns the names of the expert parameters."""
    if dims.ep == 1:
        return set()
    calls = program.expert_calls()
    names = {name for call in calls for name in call.region.params}
    e = dims.ep_rank(dp_rank)
    counts = {call.region.experts for call in calls}
    if len(counts) != 1:
        raise ShardingError(f"ep={dims.ep}: MoE layers with different numbers of experts {sorted(counts)} are not built yet")
    per_rank = counts.pop() // dims.ep
    params = dict(program.named_parameters())
    program.set_tensors({name: nn.Parameter(params[name].detach()[e * per_rank:(e + 1) * per_rank].clone(),
                                            requires_grad=params[name].requires_grad) for name in names})
    program.bind_experts(ExpertGroup(group, e, dims.ep, per_rank))
    return names
