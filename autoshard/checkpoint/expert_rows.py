"""Expert parameters in sharded checkpoints: written as rows of the experts dim, read back at any ep.

With ep > 1 a rank holds experts lo..hi-1 of each MoE layer (and, with tp, its tensor-parallel
slice of each). The first expert-parallel group (dp ranks 0..ep-1) writes them: tensor-parallel rank 0
of each gathers its group's slices into whole experts and writes rows lo..hi-1 of dim 0, so the
checkpoint holds every expert once, laid out on the experts dim whatever the tp was. A rank reading
them takes the rows its tp layout needs of the whole experts dim (any tp layout reads from any
other), then its own experts.
"""
from __future__ import annotations

import torch
from torch import nn

from autoshard.checkpoint.index import PieceReader
from autoshard.compile.program import ShardedProgram
from autoshard.parallel.comm import write_rows
from autoshard.world import current

__all__ = ["ExpertRows"]


class ExpertRows:
    """Where one rank's expert parameters go in a checkpoint (see the module docstring)."""

    def __init__(self, prog: ShardedProgram, module: nn.Module):
        group = getattr(module, "expert_group", None)
        self.names: set[str] = set(getattr(module, "expert_params", ())) if group is not None else set()
        self.prog, self.module = prog, module
        if self.names:
            self.lo, self.per = group.rank * group.per_rank, group.per_rank
            self.experts = group.per_rank * group.size

    def piece(self, name: str, t: torch.Tensor, first_holder: bool):
        """(pieces this rank writes, layout, tensor) for expert parameter `name`'s tensor `t` (or a
        same-shaped optimizer state); a collective over the tp group when tp splits it."""
        m = self.module
        writes = first_holder and m.dp_rank < m.dims.ep
        use = self.prog.sharding.params.get(name)
        if writes and use is not None and m.dims.tp > 1:     # whole experts from the tp slices
            gathered = t.new_empty((m.dims.tp, *t.shape))                  # [tp, *slice]
            m.groups.world.all_gather(gathered, t.contiguous()[None], group=m.groups.tp)
            shards = list(gathered)
            shape = list(t.shape)
            shape[use.dim] = self.prog.param_shapes[name][use.dim]
            t = t.new_zeros(shape)
            for r, shard in enumerate(shards):
                write_rows(t, shard, use.dim, use.layout[r])
        pieces = [(self.lo, self.lo + self.per, 0)] if writes and m.tp_rank == 0 else []
        return pieces, (0, [(self.lo, self.lo + self.per)], self.experts), t

    def range_of(self, name: str, experts: int) -> tuple[int, int]:
        """The experts [lo, hi) of parameter `name` (of `experts` in all) this rank holds: its own
        under expert parallelism, else all."""
        return (self.lo, self.lo + self.per) if name in self.names else (0, experts)

    def reader_for(self, name: str, reader: PieceReader):
        """How to read `name`'s tensors (the parameter, its optimizer state): `read(key, lay)`."""
        return (lambda key, lay: self.rows(reader, key, lay)) if name in self.names else reader.rows

    def rows(self, reader: PieceReader, key: str, lay) -> torch.Tensor:
        """This rank's experts of `key`, in its tp layout `lay` (None: not split over tp)."""
        if lay is None:
            return reader.rows(key, (0, [(self.lo, self.lo + self.per)], self.experts))
        return reader.rows(key, lay).narrow(0, self.lo, self.per)
