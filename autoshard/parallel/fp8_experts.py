"""FP8 experts: a grouped matmul (each expert's tokens times its weight, what transformers' grouped_mm
experts run) in float8, each expert's matmul an FP8 linear of its own (parallel/fp8_linear.py's
recipe on that expert's tokens and weight: its tensorwise scales are the expert's, its rowwise
scales the expert's rows and columns).

    y = fp8_grouped_mm(x, w, offs, recipe)     # x [S, K] grouped by expert, w [E, K, N] -> [S, N]
    with Fp8GroupedMatmuls(recipe) as mode:     # torch._grouped_mm inside: fp8_grouped_mm
        out = experts_module(hidden, top_k_index, top_k_weights)

The FP8 pass (passes/fp8_linears.py) puts `fp8_grouped_mm` in a rank graph in place of the grouped
matmul the export recorded. Expert parallelism runs the model's own experts module on the tokens
a rank receives (regions/experts_call.py): there the mode turns the module's grouped matmuls into
the same function, and the single-device FP8 model verify compares with (verify/fp8_model.py) runs
its experts the same way.

Scales need no group: an expert's weight is whole on the rank that owns it (experts tp splits stay
in the model's dtype: the pass's table). An expert's tokens are those of the call; so that they are
the tokens the single-device model sees for the same microbatch, an experts call under expert
parallelism runs each source rank's tokens as a call of their own (`dispatch_combine(per_source=True)`).
"""
from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

from autoshard.parallel.fp8_linear import fp8_matmuls

__all__ = ["fp8_grouped_mm", "Fp8GroupedMatmuls", "GROUPED_MATMULS"]

# what transformers' grouped_mm experts call: torch's grouped matmul, and transformers' own fallback
# op (where torch's has no kernel, and what an export of an fp32 model records)
GROUPED_MATMULS = ("aten::_grouped_mm", "transformers::grouped_mm_fallback")


def fp8_grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, recipe: str) -> torch.Tensor:
    """Rows offs[e-1]..offs[e] of x times w[e], in float8 (see the module doc); rows past offs[-1]
    (expert-parallel sentinels, which the grouped kernels skip) are zeros."""
    if offs.is_meta:        # a memory prediction's run (planning/meta_step.py): the tokens spread evenly, as planned
        ends = [(e + 1) * x.shape[0] // w.shape[0] for e in range(w.shape[0])]
    else:
        ends = [int(e) for e in offs.tolist()]
    groups = [(e, a, b) for e, (a, b) in enumerate(zip([0, *ends[:-1]], ends)) if b > a]
    if not groups:       # no expert has a token: zeros, still a function of w (its gradient zeros, not None)
        return x.new_zeros(x.shape[0], w.shape[-1]) + w.flatten()[:0].sum() + x.flatten()[:0].sum()
    outs = fp8_matmuls(recipe, [(x[a:b], w[e].t()) for e, a, b in groups])
    tail = x.shape[0] - ends[-1]
    return torch.cat([*outs, *([x.new_zeros(tail, w.shape[-1])] if tail else [])])


def _op_name(func) -> str | None:
    if func is torch._grouped_mm:
        return "aten::_grouped_mm"
    name = getattr(func, "_qualified_op_name", None) or (func.name() if isinstance(func, torch._ops.OpOverload)
                                                          else None)
    return name.split(".")[0] if name else None


class Fp8GroupedMatmuls(TorchFunctionMode):
    """Inside: the grouped matmuls (GROUPED_MATMULS) run as fp8_grouped_mm; `calls` counts them, so
    a caller can see that an experts module it meant to run in float8 did."""

    def __init__(self, recipe: str):
        super().__init__()
        self.recipe, self.calls = recipe, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _op_name(func) not in GROUPED_MATMULS:
            return func(*args, **kwargs)
        x, w, *rest = args
        offs = kwargs.get("offs", rest[0] if rest else None)
        if offs is None or x.dim() != 2 or w.dim() != 3 or kwargs.get("bias") is not None:
            raise NotImplementedError(f"FP8 experts: a grouped matmul of x {tuple(x.shape)} and w {tuple(w.shape)} "
                                      f"(offs {'given' if offs is not None else 'missing'}, bias "
                                      f"{'given' if kwargs.get('bias') is not None else 'none'}); the FP8 form is "
                                      f"2-D x, 3-D w, offsets and no bias")
        self.calls += 1
        y = fp8_grouped_mm(x, w, offs, self.recipe)
        out_dtype = kwargs.get("out_dtype")
        return y if out_dtype is None else y.to(out_dtype)
