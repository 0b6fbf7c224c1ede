"""FP8 linears: a matmul against a weight run in float8 (`torch._scaled_mm`), its forward and both
backward matmuls, with dynamic scales computed from each operand's absolute maximum (amax).

    y = x @ w.T        x [M, K] (tokens x input features), w [N, K] (output x input features)

A scale is amax / the format's largest value (448 for e4m3, 57344 for e5m2); an operand is divided
by its scale, clamped to the format's range (a cast out of range gives NaN, not the largest value)
and cast; `_scaled_mm` multiplies the scales back into its bf16 (the input's dtype) result. Two
recipes, named as torchao names them:

- tensorwise (the default: one all-reduce of a scalar per scale where tp divides the tensor, the
  fastest recipe on Hopper): one scale per tensor. x and w in e4m3 (more mantissa, for values);
  the output gradient in e5m2 (more exponent: gradients span more orders of magnitude than
  activations). Backward reuses the forward's float8 x and w: grad_x = go8 @ w8, grad_w = go8.T @ x8.
- rowwise: one scale per row of each operand along the matmul's contraction dim, all e4m3 (a
  row's range is narrow enough): forward x per token and w per output feature; for grad_x the
  output gradient per token and w per input feature; for grad_w the output gradient per output
  feature and x per input feature (both over the tokens). Backward recasts from the bf16 x and w it
  saved, along the other dim.

Tensor parallelism: a column-parallel weight holds 1/tp of the output features N, a row-parallel
one 1/tp of the input features K (and then x holds 1/tp of K too). An amax over a dim the tp group
divides is taken over the group (`Reducer.max`), so each rank scales with the number the
single-device FP8 model computes on the whole tensor: column-parallel, the tensorwise w and output
gradient, the rowwise output gradient for grad_x (per token, over N) and the rowwise w for grad_x
(per input feature, over N); row-parallel, the tensorwise x and w, the rowwise x (per token, over
K) and the rowwise w forward (per output feature, over K). Amaxes over the tokens are this rank's
microbatch's, as the single-device model's are for the same microbatch (`reduce=False` turns the
group's max off: the check that shows it is needed). The casts of a shard are then the whole
tensor's element for element; what tp still adds in the model's dtype is its partial sums (g's
all-reduce of the row-parallel outputs, f's of the input gradients), as Megatron adds them in bf16.

Context parallelism: a cp rank holds 1/cp of each sequence's tokens and the whole weights, so an
amax over the tokens is taken over the cp group too (the tensorwise x and output gradient, the
rowwise grad_w's scales over the tokens); amaxes per token or over a weight are the rank's own. The
grad_w of each cp rank is then its tokens' part of the single-device one, in the same float8
values, and the data-parallel reduction sums the parts.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from autoshard.parallel.comm import SIMULATED, Collective, CommHandle, Ranked, distributed_reducer
from autoshard.parallel.context_parallel import context_groups

__all__ = ["FP8_RECIPES", "Fp8Linear", "Fp8LinearSpec", "E4M3", "E5M2", "fp8_matmuls"]

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8_RECIPES = ("tensorwise", "rowwise")
_TINY = 1e-12          # the smallest amax a scale is made from: an all-zero row scales by this


Max = Callable[[Ranked], Ranked]       # each rank's amax -> its group's max, for the ranks present


def _scale(amaxes: list[torch.Tensor], over: list[Max | None], fmt: torch.dtype) -> list[torch.Tensor]:
    """fp32 scales from each rank's amaxes, after the max over each group in `over` (None: none);
    float64 ones from float64 operands (see `_mm`)."""
    amaxes = [a if a.dtype == torch.float64 else a.float() for a in amaxes]
    for group_max in over:
        if group_max is not None:
            amaxes = group_max(amaxes)
    return [a.clamp(min=_TINY) / torch.finfo(fmt).max for a in amaxes]


def _cast(t: torch.Tensor, scale: torch.Tensor, fmt: torch.dtype) -> torch.Tensor:
    limit = torch.finfo(fmt).max
    return (t.to(scale.dtype) / scale).clamp(-limit, limit).to(fmt)


def _mm(a8: torch.Tensor, b8: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """a8 @ b8 with their scales; `_scaled_mm` takes a row-major and b column-major, and a contraction
    dim that is a multiple of 16: grad_w's is the tokens, any number of them (an expert's), so it is
    padded with zeros, which add nothing to the sums.

    A float64 result (what `autoshard verify` computes in: _scaled_mm has no float64) is the same
    float8 values times their scales, summed in float64: the casts, and so the recipe, are the same,
    the products exact, and the sums lose nothing, so two programs that differ only in summation
    order elsewhere agree to float64's precision instead of parting wherever an fp32 ulp moved a
    value across a float8 rounding step."""
    if dtype == torch.float64:
        return (a8.to(dtype) * sa.to(dtype)) @ (b8.to(dtype) * sb.to(dtype))
    k = a8.shape[1]
    if k % 16:
        a8 = torch.cat([a8, a8.new_zeros(a8.shape[0], 16 - k % 16)], 1)
        b8 = torch.cat([b8, b8.new_zeros(16 - k % 16, b8.shape[1])], 0)
    return torch._scaled_mm(a8.contiguous(), b8.t().contiguous().t(), scale_a=sa, scale_b=sb, out_dtype=dtype)


class _Fp8Matmul(torch.autograd.Function):
    """y = x @ w.T on every rank present, in float8 (see the module doc); inputs x0, w0, x1, w1, ...
    `row`, `column`: the tp group's max where tp splits w's input (row) or output (column) features,
    else None; `tokens`: the cp group's max where cp splits the tokens, else None."""

    @staticmethod
    def forward(ctx, recipe: str, row: Max | None, column: Max | None, tokens: Max | None, *xw: torch.Tensor):
        xs, ws = [x.reshape(-1, x.shape[-1]) for x in xw[0::2]], list(xw[1::2])
        if recipe == "tensorwise":
            sx = _scale([x.abs().amax() for x in xs], [row, tokens], E4M3)
            sw = _scale([w.abs().amax() for w in ws], [row or column], E4M3)
            x8 = [_cast(x, s, E4M3) for x, s in zip(xs, sx)]
            w8 = [_cast(w, s, E4M3) for w, s in zip(ws, sw)]
            ys = [_mm(a, b.t(), s, t, x.dtype) for a, b, s, t, x in zip(x8, w8, sx, sw, xs)]
            ctx.save_for_backward(*x8, *w8, *sx, *sw)
        else:
            sx = _scale([x.abs().amax(1, keepdim=True) for x in xs], [row], E4M3)        # [M, 1]
            sw = _scale([w.abs().amax(1, keepdim=True) for w in ws], [row], E4M3)        # [N, 1]
            ys = [_mm(_cast(x, s, E4M3), _cast(w, t, E4M3).t(), s, t.t(), x.dtype)
                  for x, w, s, t in zip(xs, ws, sx, sw)]
            ctx.save_for_backward(*xs, *ws)
        ctx.args = (recipe, column, tokens, len(ws), [x.shape for x in xw[0::2]], [w.dtype for w in ws],
                    [x.dtype for x in xs])
        return tuple(ys)        # [M, N] each: the caller takes them back to x's leading dims (_matmuls)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        recipe, column, tokens, n, shapes, wtypes, xtypes = ctx.args
        saved = ctx.saved_tensors
        gs = [g.reshape(-1, g.shape[-1]) for g in grads]
        if recipe == "tensorwise":
            x8, w8, sx, sw = saved[:n], saved[n:2 * n], saved[2 * n:3 * n], saved[3 * n:]
            sg = _scale([g.abs().amax() for g in gs], [column, tokens], E5M2)
            g8 = [_cast(g, s, E5M2) for g, s in zip(gs, sg)]
            dx = [_mm(g, w, s, t, xt) for g, w, s, t, xt in zip(g8, w8, sg, sw, xtypes)]
            dw = [_mm(g.t(), x, s, t, dt) for g, x, s, t, dt in zip(g8, x8, sg, sx, wtypes)]
        else:
            xs, ws = saved[:n], saved[n:]
            sg = _scale([g.abs().amax(1, keepdim=True) for g in gs], [column], E4M3)        # per token, over N
            sw = _scale([w.abs().amax(0, keepdim=True) for w in ws], [column], E4M3)        # per input feature
            dx = [_mm(_cast(g, s, E4M3), _cast(w, t, E4M3), s, t, xt) for g, w, s, t, xt in zip(gs, ws, sg, sw, xtypes)]
            sgt = _scale([g.abs().amax(0, keepdim=True).t() for g in gs], [tokens], E4M3)   # [N, 1], over tokens
            sxt = _scale([x.abs().amax(0, keepdim=True) for x in xs], [tokens], E4M3)       # [1, K], over tokens
            dw = [_mm(_cast(g.t(), s, E4M3), _cast(x, t, E4M3), s, t, dt)
                  for g, x, s, t, dt in zip(gs, xs, sgt, sxt, wtypes)]
        grads_in = [None] * 4
        for d, w, shape in zip(dx, dw, shapes):
            grads_in += [d.reshape(shape), w]
        return tuple(grads_in)


def fp8_matmuls(recipe: str, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
    """x @ w.T for each (x, w), each its own FP8 linear with its own scales (no group): the experts'
    matmuls (parallel/fp8_experts.py)."""
    return _matmuls(recipe, None, None, None, [t for x, w in pairs for t in (x, w)])


def _matmuls(recipe: str, row: Max | None, column: Max | None, tokens: Max | None,
             xw: list[torch.Tensor]) -> list[torch.Tensor]:
    """_Fp8Matmul's [M, N] outputs as [..., N], x's leading dims: reshaped outside the function, so
    that they are autograd's ordinary views (the model may write into them in place: Falcon adds its
    bias with +=), not views made inside a custom Function, which autograd forbids writing into."""
    outs = _Fp8Matmul.apply(recipe, row, column, tokens, *xw)
    return [y.reshape(*x.shape[:-1], y.shape[-1]) for y, x in zip(outs, xw[0::2])]


def _grouped_max(groups: list[list[int]]) -> Max:
    """The simulator's max over each group of the ranks present (`groups`: their indices)."""
    def group_max(xs: Ranked) -> Ranked:
        out = list(xs)
        for group in groups:
            for i, m in zip(group, SIMULATED.max([xs[i] for i in group])):
                out[i] = m
        return out
    return group_max


@dataclass(frozen=True)
class Fp8LinearSpec:
    """The FP8 pass's request for an `Fp8Linear` module named `module` (passes/fp8_linears.py)."""

    module: str
    recipe: str
    role: str | None          # "column", "row" or None (a weight tp does not divide)
    cp: int = 1               # context-parallel ranks sharing the tokens
    reduce: bool = True       # False: each rank scales by its own shard's amax (wrong; for the check)

    def build(self, handle: CommHandle, cp_handle: CommHandle) -> "Fp8Linear":
        return Fp8Linear(handle, self.recipe, self.role, self.reduce, cp_handle if self.cp > 1 else None, self.cp)


class Fp8Linear(Collective):
    """x @ w.T in float8 with the recipe's dynamic scales, amaxes over tp where it divides the tensor
    and over cp where they span the tokens."""

    # simulated: the tp groups' maxes and the cp groups' (which span the tp groups), given the groups
    spans_groups = True

    def __init__(self, handle: CommHandle, recipe: str, role: str | None, reduce: bool = True,
                 cp_handle: CommHandle | None = None, cp: int = 1):
        super().__init__(handle)
        if recipe not in FP8_RECIPES:
            raise ValueError(f"fp8 recipe {recipe!r}: one of {', '.join(FP8_RECIPES)}")
        if (cp > 1) != (cp_handle is not None):
            raise ValueError(f"an Fp8Linear at cp={cp} takes the context-parallel handle exactly when cp > 1")
        self.recipe, self.role, self.reduce, self.cp_handle, self.cp = recipe, role, reduce, cp_handle, cp

    def forward(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        # a weight tp does not divide needs no tp group (a tp=1 program has none bound)
        tp_max = distributed_reducer(self.handle).max if self.reduce and self.role else None
        cp_max = distributed_reducer(self.cp_handle).max if self.reduce and self.cp > 1 else None
        return self._apply(tp_max, cp_max, x, w)[0]

    @classmethod
    def simulate(cls, mods: list["Fp8Linear"], rank_args: list[tuple], groups: list[list[int]] | None = None) -> list:
        m = mods[0]
        tp_groups = groups if groups is not None else [list(range(len(mods)))]
        tp_max = _grouped_max(tp_groups) if m.reduce and m.role else None
        cp_groups = context_groups(groups, m.cp) if groups is not None else tp_groups     # as ContextCollective's
        cp_max = _grouped_max(cp_groups) if m.reduce and m.cp > 1 else None
        return list(m._apply(tp_max, cp_max, *[t for x, w in rank_args for t in (x, w)]))

    def _apply(self, tp_max: Max | None, cp_max: Max | None, *xw: torch.Tensor) -> tuple[torch.Tensor, ...]:
        row, column = (tp_max, None) if self.role == "row" else (None, tp_max)
        return tuple(_matmuls(self.recipe, row, column, cp_max, list(xw)))

    def extra_repr(self) -> str:
        return f"recipe={self.recipe}, role={self.role}" + (f", cp={self.cp}" if self.cp > 1 else "") \
            + ("" if self.reduce else ", reduce=False")
