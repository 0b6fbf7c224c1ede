"""Where pipeline stages come from and which pipeline ranks hold each parameter.

`StageLayout` cuts a rank graph into pp * virtual stage graphs (passes/stages.py), once per graph,
and reads from rank 0's stages which pipeline ranks read each parameter: a tied embedding is held
by the first and the last stage, and the runtime sums its gradient over those ranks (under the "v"
placement both are rank 0's: its two chunks read the one parameter).
"""
from __future__ import annotations

import torch.fx as fx

from autoshard.passes.stages import StageGraph, split_stages
from autoshard.runtime.schedules import stage_owner

__all__ = ["StageLayout"]


def _is_f(n: fx.Node) -> bool:
    return n.op == "call_module" and n.target == "f"     # identity forward: placed late, next to its user


class StageLayout:
    """pp * virtual stages per rank graph (cached by graph), and the parameters' pipeline ranks."""

    def __init__(self, pp: int, virtual: int, names_with_ties: set[str], rank0: fx.Graph, placement: str = "loop",
                 counts: list[int] | None = None, predicted: list[float] | None = None):
        self.pp, self.virtual, self.names_with_ties = pp, virtual, names_with_ties
        self.counts = counts                            # layers per stage (None: even counts)
        self.predicted = predicted                      # each stage's predicted forward seconds, if known
        self._stages: dict[int, tuple[fx.GraphModule | fx.Graph, list[StageGraph]]] = {}
        self.param_holders: dict[str, set[int]] = {}    # parameter -> pipeline ranks reading it
        for sg in self.stage_graphs(rank0):
            for n in sg.graph.nodes:
                if n.op == "get_attr":
                    self.param_holders.setdefault(n.target, set()).add(stage_owner(sg.index, pp, placement)[0])
        self.shared_params: dict[tuple[int, ...], list[str]] = {}   # pipeline ranks -> what they all read
        for name, holders in self.param_holders.items():
            if len(holders) > 1:
                self.shared_params.setdefault(tuple(sorted(holders)), []).append(name)

    def stage_graphs(self, gm: fx.GraphModule | fx.Graph, cache: bool = True) -> list[StageGraph]:
        """The pp * virtual stage graphs cut from one rank graph `gm` (cached unless `cache` is
        False; `gm` is kept alive with its entry so its id is not reused)."""
        if not cache and id(gm) not in self._stages:
            return split_stages(gm, self.pp * self.virtual, self.names_with_ties, late=_is_f, counts=self.counts)
        if id(gm) not in self._stages:
            self._stages[id(gm)] = (gm, split_stages(gm, self.pp * self.virtual, self.names_with_ties, late=_is_f,
                                                     counts=self.counts))
        return self._stages[id(gm)][1]
