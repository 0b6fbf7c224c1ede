"""The rank programs a ShardedProgram has cut so far, and how one is cut.

    cut = CutRanks(prog)
    rank = cut.get(r)                  # tensor-parallel rank r: its shards of every parameter
    rank = cut.get(r, ep_rank=e)       # ... of expert-parallel rank e: of the experts, only its own
    rank = cut.get(r, cp_rank=c)       # ... of context-parallel rank c: the same shards, its tokens' graph
    rank = cut.get(r, ep_rank=e, cp_rank=c)      # both
    rank = cut.get(r, copy=k)          # another instance of the same rank (k > 0): a mesh rank of a local world

Each rank is cut once, from one state of the model (compile/weights.py's WeightSource), and keeps
the graphs of every signature compiled so far and later. At ep > 1 the stacked expert parameters
[experts, ...] are cut to the expert-parallel rank's consecutive experts in the same step as the
tp shards, so no process ever holds another rank's experts.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn

from autoshard.compile.rank import RankProgram
from autoshard.compile.weights import copy_into_rank, rank_slice
from autoshard.errors import ShardingError
from autoshard.parallel.expert_parallel import ExpertGroup
from autoshard.passes.rewrite.rank_rewrite import RankGraph

__all__ = ["CutRanks", "building", "experts_per_rank"]


def building() -> contextlib.ExitStack:
    """Ranks and graphs are built on first use, under whatever mode that call runs in: they are
    built with gradients on and outside inference mode, whatever it is (a first call under
    torch.inference_mode() would otherwise make every parameter an inference tensor, unusable in
    training ever after)."""
    stack = contextlib.ExitStack()
    stack.enter_context(torch.inference_mode(False))
    stack.enter_context(torch.enable_grad())
    return stack


def experts_per_rank(rank0: RankGraph, ep: int) -> int | None:
    """Experts each expert-parallel rank holds of every MoE layer (None without expert parallelism)."""
    counts = {region.experts for region in rank0.experts}
    if ep == 1 or not counts:
        return None
    if len(counts) != 1:
        raise ShardingError(f"ep={ep}: MoE layers with different numbers of experts {sorted(counts)} are not built yet")
    return counts.pop() // ep


class CutRanks:
    """Every rank program cut from `prog`'s model so far: key r (tensor-parallel rank r, all experts),
    (r, e) (expert-parallel rank e's), or (r, e or None, "cp", c) (context-parallel rank c > 0's); a
    copy k > 0 of any of them is keyed (key, k). A torchrun process runs one mesh rank and cuts each
    rank once; a local world (runtime/local_mesh.py) runs every mesh rank on one program, and mesh
    ranks holding the same shards (other pipeline or data-parallel positions) need parameters of
    their own, so each takes its own copy, sharing the compiled graphs."""

    def __init__(self, prog):
        self._prog = prog
        self._ranks: dict[int | tuple[int, int], RankProgram] = {}

    def all(self) -> list[RankProgram]:
        return list(self._ranks.values())

    def get(self, r: int, ep_rank: int | None = None, cp_rank: int | None = None, copy: int = 0) -> RankProgram:
        prog = self._prog
        if not 0 <= r < prog.tp:
            raise IndexError(f"rank {r} out of range for world size {prog.tp}")
        if cp_rank is not None and not 0 <= cp_rank < prog.cp:
            raise IndexError(f"cp_rank {cp_rank} out of range for cp={prog.cp}")
        if ep_rank is not None and prog.dims.ep == 1:
            raise ShardingError(f"ep_rank={ep_rank}: this program has no expert parallelism (ep=1); use prog.rank({r})")
        if ep_rank is not None and not 0 <= ep_rank < prog.dims.ep:
            raise IndexError(f"ep_rank {ep_rank} out of range for ep={prog.dims.ep}")
        key = r if ep_rank is None else (r, ep_rank)
        if cp_rank:                 # context-parallel rank 0 is the plain rank r
            key = (r, ep_rank, "cp", cp_rank)
        if copy:
            key = (key, "copy", copy)
        if key not in self._ranks:
            with building():
                self._ranks[key] = self._cut(r, ep_rank, cp_rank or 0)
            self.check_all_cut()
        return self._ranks[key]

    def check_all_cut(self) -> None:
        """Once every rank there is to cut is cut, a loaded state is no longer needed."""
        prog = self._prog
        originals = [k for k in self._ranks if not (isinstance(k, tuple) and k[1:2] == ("copy",))]
        if len(originals) == prog.tp * (1 if prog.dims.ep == 1 else 1 + prog.dims.ep) * prog.cp:
            prog._source.all_cut()

    def _cut(self, r: int, ep_rank: int | None, cp_rank: int = 0) -> RankProgram:
        prog = self._prog
        full = prog._source.tensors(cut=list(self._ranks))      # one state of the model for every rank
        trainable = {name: p.requires_grad for name, p in prog.model.named_parameters()}
        group = None if ep_rank is None else ExpertGroup(None, ep_rank, prog.dims.ep, prog.experts_per_rank)
        params = {name: nn.Parameter(rank_slice(full[name], prog.sharding.params.get(name), r,
                                                group if name in prog.expert_params else None).clone(),
                                     requires_grad=grad) for name, grad in trainable.items()}
        rank = RankProgram(r, prog.tp, params, prog._bind, compile_for=prog._compile, cp_rank=cp_rank, cp=prog.cp)
        rank.expert_params = prog.expert_params if group is not None else set()
        rank.train(prog._training)
        rank.rng.manual_seed(prog._seed)
        for entry in prog._compiler.compiled:
            prog._add_graph(rank, entry)
        if group is not None:
            rank.bind_experts(group)
        copy_into_rank(rank, prog.sharding.params, {n: t for n, t in full.items() if n not in params})   # buffers
        return rank
