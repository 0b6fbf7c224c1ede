"""The cost model's closed forms, kept symbolic (sympy) so they can be printed, differentiated and
checked against the papers, and evaluated per configuration through `evaluate`.

Symbols: h hidden, l layers, a heads, V vocabulary, s sequence, b microbatch, B global batch,
t tensor-parallel, p pipeline, d data-parallel, v virtual stages (interleaving), m microbatches
per pipeline and step (B / (d b)); mixture-of-experts layers: E experts of FFN width F (SwiGLU:
gate, up and down matrices), K experts per token, ep expert-parallel ranks.

Sources: FLOPs and parameters are Narayanan et al. 2021 (PTD-P), section 5.1 and appendix;
activation bytes are Korthikanti et al. 2022, section 4 (fp16 activations, 1-byte dropout masks).
"""
from __future__ import annotations

from functools import lru_cache

import sympy as sp

__all__ = ["SYMBOLS", "FORMULAS", "evaluate", "formula"]

h, l, a, V, s, b, B, t, p, d, v, m, E, F, K, ep = SYMBOLS = sp.symbols("h l a V s b B t p d v m E F K ep", positive=True)

_attn = s / (6 * h)                      # attention scores' share of a layer's matmul FLOPs
# The first pipeline stage holds the most: its layers, its vocabulary shard, the position table.
_params_gpu = (l / p) * (12 * h**2 + 13 * h) / t + V * h / t + s * h

FORMULAS: dict[str, sp.Expr] = {
    # FLOPs per iteration, counted as the paper counts them: 24 b s h^2 (1 + s/6h) per layer forward,
    # backward twice forward, the LM head 2 b s h V forward.
    "flops_full_recompute": 96 * B * s * l * h**2 * (1 + _attn + V / (16 * l * h)),
    "flops_selective_recompute": 72 * B * s * l * h**2 * (1 + _attn + s / (18 * h) + V / (12 * l * h)),
    "flops_no_recompute": 72 * B * s * l * h**2 * (1 + _attn + V / (12 * l * h)),
    "parameters": 12 * l * h**2 * (1 + 13 / (12 * h) + (V + s) / (12 * l * h)),
    "parameters_per_gpu": _params_gpu,
    # Mixed-precision Adam: fp16 weights (2) and gradients (2), fp32 master, momentum, variance (12),
    # fp32 gradient copy in the optimizer (2 more on average once buffers are reused).
    "weight_and_optimizer_bytes": 18 * _params_gpu,
    # Activation bytes of one layer for one microbatch (Korthikanti et al., equations 2-6).
    "activation_bytes_no_recompute": s * b * h * (10 + 24 / t + 5 * a * s / (h * t)),
    "activation_bytes_no_recompute_sp": s * b * h / t * (34 + 5 * a * s / h),
    "activation_bytes_selective": s * b * h * (10 + 24 / t),
    "activation_bytes_selective_sp": 34 * s * b * h / t,
    "checkpoint_bytes": 2 * s * b * h,              # full recompute keeps each layer's input
    "checkpoint_bytes_sp": 2 * s * b * h / t,
    # Layers' worth of activations alive on the first pipeline rank at the peak of 1F1B (p
    # microbatches of l/p layers) and of interleaved 1F1B (p v + p - 1 chunks of l/(p v) layers).
    "inflight_layers_1f1b": l,
    "inflight_layers_interleaved": l * (1 + (p - 1) / (p * v)),
    # Bytes each tensor-parallel all-reduce of a layer's output carries; two per layer per pass.
    "tp_allreduce_bytes": 2 * b * s * h,
    # A ring all-reduce moves 2 (t - 1)/t of the buffer through each link. Sequence parallelism
    # replaces each all-reduce by an all-gather and a reduce-scatter, (t - 1)/t each: the same bytes.
    "ring_allreduce_factor": 2 * (t - 1) / t,
    "sp_allgather_reduce_scatter_factor": (t - 1) / t + (t - 1) / t,
    # Pipeline send of one microbatch's hidden states, split over the t ranks of the stage
    # (Megatron's scatter/gather) and all-gathered on the far side over NVLink.
    "p2p_bytes_per_gpu": 2 * b * s * h / t,
    "dp_allreduce_bytes": 2 * _params_gpu,          # fp16 gradients
    "microbatches": B / (d * b),
    # Mixture of experts (a layer's MLP replaced by E SwiGLU experts and a router): per layer on one
    # rank, the experts' and router's weights, and the forward FLOPs of one microbatch (K experts
    # per token, routed evenly; 16 b s h^2 is the dense 4h MLP they replace).
    "moe_params_per_layer_gpu": 3 * h * F * E / (t * ep) + h * E,
    "moe_mlp_flops_forward": 2 * b * s * h * (3 * K * F + E),
    "dense_mlp_flops_forward": 16 * b * s * h**2,
    # One all-to-all of a microbatch's routed tokens (2-byte values): each rank sends its b s K
    # (token, expert) rows of h values, the (ep - 1)/ep of them whose expert lives elsewhere.
    "moe_all_to_all_bytes": 2 * b * s * K * h * (ep - 1) / ep,
    "bubble_fraction": (p - 1) / (v * m),
}


def formula(name: str) -> sp.Expr:
    if name not in FORMULAS:
        raise KeyError(f"no formula {name!r}; known: {', '.join(FORMULAS)}")
    return FORMULAS[name]


_NAMES = tuple(str(x) for x in SYMBOLS)
_KNOWN = frozenset(_NAMES)


@lru_cache(maxsize=None)
def _compiled(name: str):
    """`name`'s formula as a function of every symbol in SYMBOLS' order, and the names it needs."""
    expr = formula(name)
    return sp.lambdify(SYMBOLS, expr, "math"), frozenset(str(x) for x in expr.free_symbols)


def evaluate(name: str, **values: float) -> float:
    """`name`'s formula at `values` (keyword per symbol; unused symbols may be left out). The planner
    calls this some 10^5 times a search: symbols' names are read once per formula, not per call."""
    fn, needs = _compiled(name)
    if not values.keys() <= _KNOWN:
        raise TypeError(f"unknown symbols {sorted(set(values) - _KNOWN)}; symbols are {list(_NAMES)}")
    if not needs <= values.keys():
        raise TypeError(f"formula {name!r} needs {sorted(needs - set(values))}")
    return float(fn(*(values.get(x, 1) for x in _NAMES)))
