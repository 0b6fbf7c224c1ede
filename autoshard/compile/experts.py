"""The module an outlined experts call runs (passes/experts.py outlines them), and which modules of a
model are experts modules.

`EXPERT_MODULES` is the table of experts-module forms expert parallelism knows: a test on the
module, and how to read its count of experts. Today one row: Hugging Face's experts interface
(transformers 5's `use_experts_implementation`: Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek, gpt-oss...),
whose forward is `(hidden [n, H], top_k_index [n, k], top_k_weights [n, k]) -> [n, H]` over the
`num_experts` experts its stacked parameters hold.

`ExpertsCall` runs the region's graph as exported while no expert-parallel group is bound. Bound
(`bind(ExpertGroup)`, done by the runtime, which also cuts the parameters to this rank's experts), it
dispatches the (token, slot) pairs to their experts' owners and runs the model's own experts module
there, on this rank's parameter slices (`torch.func.functional_call` on a copy of the module that
holds no weights, its `num_experts` set to the local count). A region whose experts are also split
over tensor-parallel ranks applies Megatron's f to the tokens and weights sent (their gradients are
partial sums over the tp ranks) and g to the combined output (each tp rank holds a partial sum).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable

import torch
import torch.fx as fx
from torch import nn

from autoshard.compile.simulate import run_lockstep
from autoshard.errors import ShardingError
from autoshard.parallel.expert_parallel import ExpertGroup, dispatch_combine
from autoshard.passes.experts import ExpertRegion

__all__ = ["EXPERT_MODULES", "ExpertsCall", "expert_modules", "weightless_copy"]


@dataclass(frozen=True)
class ExpertForm:
    name: str
    matches: Callable[[nn.Module], bool]
    count: Callable[[nn.Module], int]


EXPERT_MODULES = [
    ExpertForm("transformers experts interface",
               lambda m: hasattr(m, "_is_expert_parallel") and isinstance(getattr(m, "num_experts", None), int),
               lambda m: m.num_experts),
]


def expert_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Module path -> experts module, for every module of `model` a row of EXPERT_MODULES matches."""
    return {path: m for path, m in model.named_modules() if any(form.matches(m) for form in EXPERT_MODULES)}


def expert_count(module: nn.Module) -> int:
    return next(form.count(module) for form in EXPERT_MODULES if form.matches(module))


def weightless_copy(module: nn.Module) -> nn.Module:
    """A shallow copy of an experts module whose own parameters are meta tensors (its code and
    settings without its weights); `functional_call` supplies the weights."""
    view = copy.copy(module)
    view._parameters = {k: None if p is None else nn.Parameter(torch.empty_like(p, device="meta"), p.requires_grad)
                        for k, p in module._parameters.items()}
    view._buffers, view._modules = dict(module._buffers), dict(module._modules)
    return view


class ExpertsCall(nn.Module):
    """One experts call of a rank graph (see the module docstring)."""

    def __init__(self, body: fx.GraphModule, region: ExpertRegion, experts: nn.Module,
                 f: nn.Module | None, g: nn.Module | None):
        super().__init__()
        self.body = body
        self.region = region
        object.__setattr__(self, "_experts", experts)         # plain attributes: not submodules
        object.__setattr__(self, "_sync", (f, g))
        self.ep: ExpertGroup | None = None

    def bind(self, ep: ExpertGroup) -> None:
        if self.region.experts != ep.per_rank * ep.size:
            raise ValueError(f"{self.region.path}: {self.region.experts} experts, but the group gives "
                             f"{ep.size} ranks x {ep.per_rank}")
        self.ep = ep
        self._experts.num_experts = ep.per_rank

    def forward(self, *args):
        if self.ep is None:
            return self.body(*args)
        r = self.region
        x, idx, w = args[r.hidden], args[r.index], args[r.weights]
        weights = {name.rsplit(".", 1)[-1]: args[i] for name, i in r.params.items()}
        f, g = self._sync
        if r.tensor_parallel:
            x, w = f(x), f(w)

        def run_local(xs, ids, ws):
            return torch.func.functional_call(self._experts, weights, (xs, ids, ws))

        out = dispatch_combine(x, idx, w, run_local, self.ep)
        if r.tensor_parallel:
            out = g(out)
        return (out.to(x.dtype),)

    @staticmethod
    def simulate(mods: list["ExpertsCall"], rank_args: list[list[object]]) -> list[object]:
        """Every tensor-parallel rank's call at once (the region's f and g meet in lockstep)."""
        if all(m.ep is None for m in mods):
            return [tuple(out) for out in run_lockstep([m.body for m in mods], rank_args, per_rank=True)]
        if len(mods) == 1:
            return [mods[0](*rank_args[0])]
        raise ShardingError(f"{mods[0].region.path}: a bound expert-parallel call with tp={len(mods)} runs "
                            "under torch.distributed only")

    def extra_repr(self) -> str:
        where = "not bound: the exported graph" if self.ep is None else \
            f"experts {self.ep.rank * self.ep.per_rank}..{(self.ep.rank + 1) * self.ep.per_rank - 1} of " \
            f"{self.region.experts} here, tokens exchanged over {self.ep.size} ranks"
        return f"{self.region.path}: {where}"
