"""Which link each collective crosses: read off the groups the runtime's mesh makes.

    link_gb_s(hw, dims, "cp")      # hw.network_gb_s if some cp group spans two nodes, else nvlink

Ranks fill nodes of `hw.gpus_per_node` in order (torchrun and srun number them node by node), and
the mesh orders them tp, cp, dp, ep within the data axis, pp outermost (runtime/mesh.py). A group
size says nothing about where its ranks are: at tp=8 on 8-GPU nodes, a cp group of 2 spans two
nodes. So the answer comes from the mesh's own rank lists (`ParallelDims.group_ranks`), the ones
MeshGroups makes the process groups from: a kind crosses when any of its groups holds ranks of two
nodes. `pp` stands for the pipeline's sends (a group of all stages at one position: a pipeline
some of whose neighbours are on other nodes pays the network on its slowest hops), `shared` for a
parameter tied between the first and last stage.
"""
from __future__ import annotations

from functools import lru_cache

from autoshard.planning.hardware import Hardware
from autoshard.runtime.mesh import ParallelDims

__all__ = ["crosses_nodes", "link_gb_s"]


@lru_cache(maxsize=4096)
def crosses_nodes(dims: ParallelDims, kind: str, per_node: int) -> bool:
    """Whether some group of `kind` (tp, cp, dp, ep, expert_dp, pp, shared) holds ranks of two nodes."""
    if kind == "shared":
        groups = dims.group_ranks("shared", (0, dims.pp - 1))
    elif kind == "cp" and dims.cp == 1 or kind in ("ep", "expert_dp") and dims.ep == 1:
        return False
    else:
        groups = dims.group_ranks(kind)
    return any(len({r // per_node for r in ranks}) > 1 for ranks in groups)


def link_gb_s(hw: Hardware, dims: ParallelDims, kind: str) -> float:
    """The bandwidth a collective of `kind`'s groups runs at on `hw`: inside a node, or across."""
    return hw.network_gb_s if crosses_nodes(dims, kind, hw.gpus_per_node) else hw.nvlink_gb_s
