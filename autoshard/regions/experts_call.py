"""The module an outlined experts call runs (passes/outline_experts.py outlines them), and which modules of a
model are experts modules.

`EXPERT_MODULES` is the table of experts-module forms expert parallelism knows: a test on the
module, and how to read its count of experts. Two rows: Hugging Face's experts interface
(transformers 5's `use_experts_implementation`: Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek, gpt-oss...),
whose forward is `(hidden [n, H], top_k_index [n, k], top_k_weights [n, k]) -> [n, H]` over the
`num_experts` experts its stacked parameters hold; and experts that read every expert's copy of the
tokens (Llama 4: `(copies [experts * n, H]) -> [experts * n, H]`, the router's scores applied to the
copies before and the copies summed after, outside the module).

`ExpertsCall` runs the region's graph as exported while no expert-parallel group is bound. Bound
(`bind(ExpertGroup)`, done by the runtime, which also cuts the parameters to this rank's experts), it
dispatches the (token, slot) pairs to their experts' owners and runs the model's own experts module
there, on this rank's parameter slices (`torch.func.functional_call` on a copy of the module that
holds no weights, its `num_experts` set to the local count). A region whose experts are also split
over tensor-parallel ranks applies Megatron's f to the tokens and weights sent (their gradients are
partial sums over the tp ranks) and g to the combined output (each tp rank holds a partial sum). A
parameter the region adds after its g (a row-parallel bias, gpt-oss's `down_proj_bias`) is added by
the model's module to every rank's partial sum: it is given its value on tp rank 0 alone and zeros
elsewhere (its gradient, the same on every rank, reaches each rank's copy), so the sum counts it once.
"""
from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass
from typing import Callable

import torch
import torch.fx as fx
from torch import nn

from autoshard.parallel.fp8_experts import Fp8GroupedMatmuls, fp8_grouped_mm
from autoshard.parallel.lockstep import run_lockstep
from autoshard.parallel.expert_parallel import ExpertGroup, RunLocal, dispatch_combine, exchange_copies
from autoshard.passes.outline_experts import ExpertRegion

__all__ = ["EXPERT_MODULES", "ExpertsCall", "expert_modules", "weightless_copy"]


@dataclass(frozen=True)
class ExpertForm:
    name: str
    matches: Callable[[nn.Module], bool]
    count: Callable[[nn.Module], int]


def _reads_every_copy(m: nn.Module) -> bool:
    """An experts module whose forward takes one tensor, every expert's copy of the tokens stacked
    expert-major ([experts * n, H]), over parameters stacked on a leading experts dim (Llama 4's
    text experts: `gate_up_proj` [E, H, 2I], `down_proj` [E, I, H])."""
    count = getattr(m, "num_experts", None)
    params = list(m.parameters(recurse=False))
    if hasattr(m, "_is_expert_parallel") or not isinstance(count, int) or not params \
            or any(p.dim() < 3 or p.shape[0] != count for p in params):
        return False
    try:
        args = [p for p in inspect.signature(m.forward).parameters.values()
                if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        return False
    return len(args) == 1


EXPERT_MODULES = [
    ExpertForm("transformers experts interface",
               lambda m: hasattr(m, "_is_expert_parallel") and isinstance(getattr(m, "num_experts", None), int),
               lambda m: m.num_experts),
    ExpertForm("experts over every expert's copy of the tokens", _reads_every_copy, lambda m: m.num_experts),
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


class _CountedOnce(torch.autograd.Function):
    """A term each tp rank adds to its partial sum before g: its value on the first rank, zeros on
    the others; backward passes the gradient to every rank's copy (g's backward is the identity, so
    each rank's is the whole gradient, as for any replicated parameter)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, first: bool) -> torch.Tensor:
        return x.clone() if first else torch.zeros_like(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class ExpertsCall(nn.Module):
    """One experts call of a rank graph (see the module docstring)."""

    spans_groups = True      # simulated: one call across every expert-parallel rank's tp group, given the groups
    def __init__(self, body: fx.GraphModule, region: ExpertRegion, experts: nn.Module,
                 f: nn.Module | None, g: nn.Module | None):
        super().__init__()
        self.body = body
        self.region = region
        object.__setattr__(self, "_experts", experts)         # plain attributes: not submodules
        object.__setattr__(self, "_sync", (f, g))
        self.ep: ExpertGroup | None = None
        # the FP8 pass put the experts' grouped matmuls in float8 (passes/fp8_linears.py): bound, the
        # model's module runs them so too, each source rank's tokens a call of their own
        self.fp8 = next((n.args[3] for n in body.graph.nodes if n.target is fp8_grouped_mm), None)

    def bind(self, ep: ExpertGroup) -> None:
        if self.region.experts != ep.per_rank * ep.size:
            raise ValueError(f"{self.region.path}: {self.region.experts} experts, but the group gives "
                             f"{ep.size} ranks x {ep.per_rank}")
        self.ep = ep
        self._experts.num_experts = ep.per_rank

    def _inputs(self, args) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, RunLocal]:
        r = self.region
        weights = {name.rsplit(".", 1)[-1]: args[i] for name, i in r.params.items()}
        if r.tensor_parallel:
            first = self._sync[0].handle.rank == 0
            for name in r.after_reduce:
                short = name.rsplit(".", 1)[-1]
                weights[short] = _CountedOnce.apply(weights[short], first)

        def run_local(*inputs):
            if self.fp8 is None:
                return torch.func.functional_call(self._experts, weights, inputs)
            with Fp8GroupedMatmuls(self.fp8) as mode:
                out = torch.func.functional_call(self._experts, weights, inputs)
            if mode.calls == 0 and inputs[0].shape[0] > 0:
                raise RuntimeError(f"{r.path}: its exported graph ran the experts' grouped matmuls in float8, but "
                                   f"the model's experts module ran none here ({type(self._experts).__name__}, "
                                   f"experts implementation {getattr(getattr(self._experts, 'config', None), '_experts_implementation', '?')!r})")
            return out
        if r.index is None:        # every expert's copy of the tokens: no index, no weights
            return args[r.hidden], None, None, run_local
        return args[r.hidden], args[r.index], args[r.weights], run_local

    def forward(self, *args):
        if self.ep is None:
            return self.body(*args)
        x, idx, w, run_local = self._inputs(args)
        f, g = self._sync
        if self.region.tensor_parallel:
            x, w = f(x), (w if w is None else f(w))
        if idx is None:
            out, = self._stacked(exchange_copies(self.ep.reducer(), [x], [run_local], self.ep.per_rank, self.ep.size))
        else:
            out, = dispatch_combine(self.ep.reducer(), [x], [idx], [w], [run_local], self.ep.per_rank, self.ep.size,
                                    per_source=self.fp8 is not None)
        if self.region.tensor_parallel and self.region.reduced:
            out = g(out)
        return (out.to(x.dtype),)

    def _stacked(self, outs: list[torch.Tensor]) -> list[torch.Tensor]:
        """Every expert's copies in the shape the exported region returned them."""
        if not self.region.stacked_out:
            return outs
        return [o.view(self.region.experts, -1, o.shape[-1]) for o in outs]

    @staticmethod
    def simulate(mods: list["ExpertsCall"], rank_args: list[list[object]],
                 groups: list[list[int]] | None = None) -> list[object]:
        """Every rank's call at once. Unbound: the tensor-parallel ranks' exported graphs (the
        region's f and g meet in lockstep). Bound (prog.simulate() at ep > 1): mods are the tp ranks
        (`groups`) of data ranks, data rank major, every run of ep data ranks one expert-parallel
        group (compile/data_replicas.py); each tp position's ep ranks exchange tokens through the
        simulator's all-to-all, each data rank's tp ranks meet in f and g."""
        if all(m.ep is None for m in mods):
            return [tuple(out) for out in run_lockstep([m.body for m in mods], rank_args, per_rank=True, groups=groups)]
        ep = mods[0].ep
        tp = len(groups[0]) if groups else len(mods) // ep.size
        inputs = [m._inputs(a) for m, a in zip(mods, rank_args)]
        xs, ws = [i[0] for i in inputs], [i[2] for i in inputs]
        if mods[0].region.tensor_parallel:
            xs = _per_tp_group(mods, 0, xs, tp)
            ws = ws if mods[0].region.index is None else _per_tp_group(mods, 0, ws, tp)
        outs: list = [None] * len(mods)
        for first, t in ((g, t) for g in range(0, len(mods) // tp, ep.size) for t in range(tp)):
            members = [(first + e) * tp + t for e in range(ep.size)]
            if mods[0].region.index is None:
                got = mods[0]._stacked(exchange_copies(ep.reducer(), [xs[i] for i in members],
                                                       [inputs[i][3] for i in members], ep.per_rank, ep.size))
            else:
                got = dispatch_combine(ep.reducer(), [xs[i] for i in members], [inputs[i][1] for i in members],
                                       [ws[i] for i in members], [inputs[i][3] for i in members], ep.per_rank,
                                       ep.size, per_source=mods[0].fp8 is not None)
            for i, o in zip(members, got):
                outs[i] = o
        if mods[0].region.tensor_parallel and mods[0].region.reduced:
            outs = _per_tp_group(mods, 1, outs, tp)
        return [(o.to(x.dtype),) for o, x in zip(outs, xs)]

    def extra_repr(self) -> str:
        where = "not bound: the exported graph" if self.ep is None else \
            f"experts {self.ep.rank * self.ep.per_rank}..{(self.ep.rank + 1) * self.ep.per_rank - 1} of " \
            f"{self.region.experts} here, tokens exchanged over {self.ep.size} ranks"
        return f"{self.region.path}: {where}"


def _per_tp_group(mods: list[ExpertsCall], which: int, values: list, tp: int) -> list:
    """f (which=0) or g (which=1) of each expert-parallel rank's tensor-parallel ranks, simulated."""
    out = []
    for e in range(len(mods) // tp):
        sync = [mods[e * tp + t]._sync[which] for t in range(tp)]
        out += type(sync[0]).simulate(sync, [(v,) for v in values[e * tp:(e + 1) * tp]])
    return out
