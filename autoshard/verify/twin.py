"""The reduced twin of a model too large to run on one device here: a Hugging Face config kept in
everything the rewrite depends on and shrunk in the rest.

Kept: the attention head count and key/value head count (so the kv-head assignment at kv < tp, the
head splits and grouped-query repeats are the same), every per-layer pattern (`layer_types` and any
other per-layer list) over at least one period, the expert counts, the position limit, and every
flag of the config. Shrunk: the layers (at least one per pipeline stage and one period of the
pattern), the head size (to 8, so the hidden size is heads x 8), the feed-forward widths (their
ratio to the hidden size kept, rounded up to a multiple of 8 x tp) and the vocabulary (to 512 at
most). The twin's rank programs are the passes' outputs for the same graph structure at other
sizes; what depends only on sizes (memory, time, a shape that fits one size and not another) is not
proved by it.
"""
from __future__ import annotations

import copy

__all__ = ["twin_config", "per_layer_lists", "TWIN_HEAD_DIM", "TWIN_VOCAB"]

TWIN_HEAD_DIM = 8
TWIN_VOCAB = 512
_FFN = ("intermediate_size", "n_inner", "moe_intermediate_size", "shared_expert_intermediate_size",
        "intermediate_size_mlp")
_HEAD_DIMS = ("head_dim", "kv_channels")
_FIRST_DENSE = ("first_k_dense_replace",)


def per_layer_lists(cfg) -> list[str]:
    """The config's attributes that hold one entry per layer."""
    n = cfg.num_hidden_layers
    return [k for k, v in vars(cfg).items() if isinstance(v, list) and len(v) == n and n > 1]


def _period(cfg, names: list[str]) -> int:
    """The shortest p such that every per-layer list repeats with period p."""
    n = cfg.num_hidden_layers
    lists = [getattr(cfg, k) for k in names]
    return next(p for p in range(1, n + 1) if all(v[i] == v[i % p] for v in lists for i in range(n)))


def twin_config(cfg, *, stages: int, tp: int):
    """(the twin's config, one line per change). `stages`: pp x virtual."""
    twin = copy.deepcopy(cfg)
    said: list[str] = []
    lists = per_layer_lists(cfg)
    period = _period(cfg, lists) if lists else 1
    first_dense = max([getattr(cfg, k, 0) or 0 for k in _FIRST_DENSE] + [0])
    layers = max(stages, first_dense + period)
    layers = -(-layers // stages) * stages
    if layers < cfg.num_hidden_layers:
        twin.num_hidden_layers = layers
        for k in lists:
            setattr(twin, k, getattr(cfg, k)[:layers])
        said.append(f"layers {cfg.num_hidden_layers} -> {layers} (>= one per stage of {stages}"
                    + (f"; per-layer pattern of period {period} in {', '.join(lists)} kept" if lists else "")
                    + (f"; the first {first_dense} dense layers kept" if first_dense else "") + ")")
    heads = cfg.num_attention_heads
    hidden = heads * TWIN_HEAD_DIM
    if hidden < cfg.hidden_size:
        twin.hidden_size = hidden
        for k in _HEAD_DIMS:
            if isinstance(getattr(cfg, k, None), int):
                setattr(twin, k, TWIN_HEAD_DIM)
        said.append(f"hidden size {cfg.hidden_size} -> {hidden} ({heads} heads of {TWIN_HEAD_DIM}; heads "
                    f"{heads} and key/value heads {getattr(cfg, 'num_key_value_heads', heads)} kept)")
        step = 8 * tp
        for k in _FFN:
            width = getattr(cfg, k, None)
            if isinstance(width, int) and width > 0:
                scaled = -(-width * hidden // cfg.hidden_size)
                setattr(twin, k, -(-scaled // step) * step)
                said.append(f"{k} {width} -> {getattr(twin, k)} (ratio to the hidden size kept)")
    if cfg.vocab_size > TWIN_VOCAB:
        twin.vocab_size = TWIN_VOCAB
        said.append(f"vocabulary {cfg.vocab_size} -> {TWIN_VOCAB}")
        for k in ("pad_token_id", "bos_token_id", "eos_token_id"):
            value = getattr(twin, k, None)
            if isinstance(value, int) and value >= TWIN_VOCAB:
                setattr(twin, k, None)
            elif isinstance(value, list):
                setattr(twin, k, [v for v in value if v < TWIN_VOCAB] or None)
    return twin, said
