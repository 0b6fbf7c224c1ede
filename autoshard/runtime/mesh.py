"""The device mesh: tp x cp x dp x pp ranks, their coordinates and their process groups.

Global rank order is Megatron's: tensor-parallel ranks are adjacent (they exchange the most bytes,
so they share a node), then context-parallel, then data-parallel, then pipeline. Context
parallelism lives inside the data-parallel axis of `data = dp * cp` ranks: data rank
j = g * cp + c is context-parallel rank c of batch replica g (the cp ranks of a replica read the
same sequences, each holding its own tokens), and every replicated parameter's gradient is summed
over the whole axis, cp and dp alike:

    rank = pp_rank * (data * tp) + data_rank * tp + tp_rank,   data_rank = dp_rank * cp + cp_rank

Expert parallelism lives inside the data-parallel axis too, as in Megatron-Core: `ep` divides
data = dp * cp, and data ranks data_rank = g * ep + e (e < ep) form expert-parallel group g, in which
rank e owns experts e * E / ep ... (e + 1) * E / ep - 1 of each MoE layer. Tokens move within the
group (a context-parallel rank's tokens are tokens like any other to an expert); an expert's
gradient is summed over the data / ep ranks holding the same experts (the same e in every group),
every other parameter's over all data ranks.
"""
from __future__ import annotations

from dataclasses import dataclass

from autoshard.errors import expert_split_problem, require_positive_int
from autoshard.world import Group, World, current

__all__ = ["ParallelDims", "MeshGroups"]


@dataclass(frozen=True)
class ParallelDims:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    ep: int = 1
    cp: int = 1

    def __post_init__(self):
        for name in ("tp", "pp", "dp", "ep", "cp"):
            require_positive_int(name, getattr(self, name))
        if (problem := expert_split_problem(self.dp, self.ep, cp=self.cp)) is not None:
            raise ValueError(problem)

    def ep_rank(self, data_rank: int) -> int:
        """This data rank's place in its expert-parallel group."""
        return data_rank % self.ep

    @property
    def data(self) -> int:
        """Ranks of the data-parallel axis: dp batch replicas of cp context-parallel ranks each."""
        return self.dp * self.cp

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.data

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(pp_rank, data_rank, tp_rank) of a global rank (data_rank = dp_rank * cp + cp_rank)."""
        if not 0 <= rank < self.world_size:
            raise IndexError(f"rank {rank} out of range for world size {self.world_size} "
                             f"(tp={self.tp} x cp={self.cp} x dp={self.dp} x pp={self.pp})")
        return rank // (self.data * self.tp), rank // self.tp % self.data, rank % self.tp

    def rank_of(self, pp_rank: int, data_rank: int, tp_rank: int) -> int:
        return pp_rank * self.data * self.tp + data_rank * self.tp + tp_rank

    def group_ranks(self, kind: str, stages: tuple[int, ...] = ()) -> list[list[int]]:
        """Every group of `kind` as global ranks, in the order MeshGroups makes them: tp, dp (the
        whole data axis), cp, ep, expert_dp, shared (the pipeline ranks `stages` at each (data, tp)
        position) and pp (all stages at each position: the pipeline's sends run between them)."""
        pp, data, tp, c, e = range(self.pp), range(self.data), range(self.tp), self.cp, self.ep
        if kind == "tp":
            return [[self.rank_of(i, j, k) for k in tp] for i in pp for j in data]
        if kind == "dp":
            return [[self.rank_of(i, j, k) for j in data] for i in pp for k in tp]
        if kind == "cp":
            return [[self.rank_of(i, g * c + j, k) for j in range(c)] for i in pp for k in tp for g in range(self.dp)]
        if kind == "ep":
            return [[self.rank_of(i, g * e + j, k) for j in range(e)] for i in pp for k in tp
                    for g in range(self.data // e)]
        if kind == "expert_dp":
            return [[self.rank_of(i, g * e + j, k) for g in range(self.data // e)] for i in pp for k in tp
                    for j in range(e)]
        if kind in ("shared", "pp"):
            return [[self.rank_of(i, j, k) for i in (stages if kind == "shared" else pp)] for j in data for k in tp]
        raise ValueError(f"no mesh group of kind {kind!r}")


class MeshGroups:
    """This rank's groups, made in its world (`world`, default: the calling thread's; world/). Every
    rank creates every group, in the same order, as torch.distributed requires; each keeps the ones
    it belongs to.

    tp: its tensor-parallel ranks. dp: the ranks holding the same shards in other data-parallel
    replicas and context-parallel ranks (gradients are summed over it). cp (cp > 1): its
    context-parallel ranks (keys and values are gathered in it). shared[ranks]: for each set of pipeline ranks that hold one parameter (a tied
    embedding: first and last stage), the group of those ranks at this (dp, tp) position.
    With ep > 1, ep: the expert-parallel group (tokens are exchanged in it); expert_dp: the ranks
    holding the same experts (experts' gradients are summed over it).
    """

    def __init__(self, dims: ParallelDims, rank: int, shared_pp_sets: list[tuple[int, ...]], world: World | None = None):
        self.dims, self.rank = dims, rank
        self.world = current() if world is None else world
        p, d, t = dims.coords(rank)
        self.tp = self._make(dims.group_ranks("tp"))
        self.dp = self._make(dims.group_ranks("dp"))
        self.cp = self._make(dims.group_ranks("cp")) if dims.cp > 1 else None
        self.shared: dict[tuple[int, ...], Group] = {}
        for pps in sorted(set(shared_pp_sets)):
            group = self._make(dims.group_ranks("shared", pps))
            if p in pps:
                self.shared[pps] = group
        self.ep = self.expert_dp = None
        if dims.ep > 1:
            self.ep = self._make(dims.group_ranks("ep"))
            self.expert_dp = self._make(dims.group_ranks("expert_dp"))

    def _make(self, rank_lists: list[list[int]]) -> Group:
        mine = None
        for ranks in rank_lists:
            group = self.world.new_group(ranks)
            if self.rank in ranks:
                mine = group
        return mine
