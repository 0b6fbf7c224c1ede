"""Mixture-of-experts layers in the cost model: what changes against the dense GPT layer.

    moe = moe_shape(model)            # MoEShape(experts=8, top_k=2, ffn=14336) from an HF config
    delta = moe_layer_costs(x, hw, moe, ep)

Each layer's MLP (the GPT layer's two 4h matrices) becomes E SwiGLU experts of width F and a router;
every token runs K of them. Routing is taken as even: each rank of an ep group receives as many
(token, expert) rows as it sends, so its experts' GEMMs are those of all b s K rows at 1/tp of the
width, whatever ep is; what ep changes is the weights each rank holds (1/ep of the experts) and two
all-to-alls per layer and pass (tokens out, results back; recomputation adds the forward's again),
each moving `moe_all_to_all_bytes` (cost_formulas) per rank. Uneven routing makes the busiest rank
slower than this; the formula is the mean.
"""
from __future__ import annotations

from dataclasses import dataclass

from autoshard.planning.collective_timing import all_to_all_seconds
from autoshard.planning.cost_formulas import evaluate
from autoshard.planning.gemm_timing import LayerShape, gemm_seconds
from autoshard.planning.hardware import Hardware

__all__ = ["MoEShape", "MoELayerCosts", "moe_shape", "moe_layer_costs"]


@dataclass(frozen=True)
class MoEShape:
    experts: int        # E
    top_k: int          # K experts per token
    ffn: int            # F: each expert's intermediate width


# Config attribute names per field, in the order tried (transformers' MoE configs).
_CONFIG_NAMES = {"experts": ("num_local_experts", "num_experts", "n_routed_experts"),
                 "top_k": ("num_experts_per_tok",),
                 "ffn": ("moe_intermediate_size", "intermediate_size")}


def moe_shape(model_or_config: object) -> MoEShape | None:
    """The MoE shape of a model (its `config`) or config; None for a dense one."""
    config = getattr(model_or_config, "config", model_or_config)
    found = {}
    for name, aliases in _CONFIG_NAMES.items():
        value = next((getattr(config, a) for a in aliases if isinstance(getattr(config, a, None), int)), None)
        if value is None:
            return None
        found[name] = value
    return MoEShape(**found) if found["experts"] > 1 else None


@dataclass(frozen=True)
class MoELayerCosts:
    """One MoE layer on one rank for one microbatch, against the dense layer: seconds added to the
    forward and backward GEMMs, all-to-all seconds per pass, parameters added, FLOPs added forward,
    and the experts' own parameters on the rank (their optimizer state divides over dp / ep)."""
    forward: float
    backward: float
    all_to_all: float
    params: float
    flops: float
    expert_params: float = 0.0


def _gemms(x: LayerShape, hw: Hardware, shapes: list[tuple[int, int, int]]) -> tuple[float, float]:
    fwd = sum(gemm_seconds(m, n, k, hw) for m, n, k in shapes)
    bwd = sum(gemm_seconds(m, k, n, hw) + gemm_seconds(k, n, m, hw) for m, n, k in shapes)
    return fwd, bwd


def moe_layer_costs(x: LayerShape, hw: Hardware, moe: MoEShape, ep: int, link_gb_s: float) -> MoELayerCosts:
    rows = x.b * x.s
    routed = rows * moe.top_k
    experts = [(routed, 2 * moe.ffn // x.t, x.h), (routed, x.h, moe.ffn // x.t), (rows, moe.experts, x.h)]
    dense = [(rows, 4 * x.h // x.t, x.h), (rows, x.h, 4 * x.h // x.t)]
    (ef, eb), (df, db) = _gemms(x, hw, experts), _gemms(x, hw, dense)
    sym = dict(b=x.b, s=x.s, h=x.h, t=x.t, K=moe.top_k, E=moe.experts, F=moe.ffn, ep=ep)
    nbytes = evaluate("moe_all_to_all_bytes", **sym) * hw.activation_bytes / 2
    layer = evaluate("moe_params_per_layer_gpu", **sym)            # experts + router on this rank
    flops = evaluate("moe_mlp_flops_forward", **sym) - evaluate("dense_mlp_flops_forward", **sym)
    return MoELayerCosts(ef - df, eb - db, 2 * all_to_all_seconds(nbytes, ep, link_gb_s, hw),
                         layer - 8 * x.h * x.h / x.t, flops, layer - x.h * moe.experts)
