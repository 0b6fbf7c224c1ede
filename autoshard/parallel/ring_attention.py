"""Ring attention over the context-parallel group: SDPA without ever holding every token's keys.

Each rank keeps its queries (q [B, H, L, E], L = S / cp tokens at global `positions`) and passes its
key/value block around the ring: at step s it holds the block of rank r - s, computes that block's
scores, and merges the partial result into its own by their log-sum-exp, kept as a running maximum
and a sum of exponentials below it (online softmax: earlier blocks rescaled by exp(m_old - m_new);
apart, since next to an additive mask of the dtype's lowest value m + log(sum) rounds to m). With `overlap`, the next block is already on its way while the
current one is computed (point-to-point sends started before the compute, waited for after it).
Backward runs the same ring: each block's scores are recomputed from the saved lse, dq accumulates
on the rank, and dk / dv accumulate on the travelling block, which one last step brings home.

The mask, if the model has one, is the table cut to the rank's query rows, every key in position
order ([.., L, S]); a block reads its keys' columns. `causal` masks key position > query position.
The key positions travel with the block, so no rank needs to know where the others' tokens are.
GQA's key/value heads (H / Hk queries each) are repeated per block, after the exchange.

Saved for backward: q, k, v of the rank's own tokens, its output, maxima and sums: O(S / cp) per layer,
where the all-gather form saves every token's keys and values (parallel/context_parallel.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from autoshard.parallel.comm import CommHandle, Reducer
from autoshard.parallel.context_parallel import ContextCollective
from autoshard.parallel.ring_pieces import heads_to_kv, repeat_heads, ring_pieces
from autoshard.parallel.ring_steps import ring_loop

__all__ = ["RingAttention", "RingAttentionSpec", "ring_attention"]


def _scores(q, k, pos, kpos, mask, scale: float, causal: bool):
    """Masked scores [B, H, L, Lk] of one block; -inf where a key is not seen."""
    rep = q.shape[1] // k.shape[1]
    k = repeat_heads(k, rep)
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if mask is not None:
        cols = mask.index_select(-1, kpos)
        s = s.masked_fill(~cols, float("-inf")) if cols.dtype == torch.bool else s + cols
    if causal:
        s = s.masked_fill(kpos[None, :] > pos[:, None], float("-inf"))
    return s


def _exp_below(s, m):
    """exp(s - m) with m a row's maximum (broadcast); 0 where the row sees no key (m = -inf)."""
    return torch.exp(s - m).nan_to_num(0.0)


def _probs(s, m, denom):
    """Backward's softmax probabilities of a block: exp(s - lse), lse = m + log(sum), as torch's SDPA
    recomputes them in its backward; 0 on rows that see no key. (A row whose every score is an
    additive mask's lowest value is uniform in forward, but m + log(sum) rounds to m, so SDPA's
    backward reads p = 1 per key there; the single-device model's gradients are those.)"""
    lse = m + torch.log(denom)
    return torch.exp(s - lse.unsqueeze(-1)).nan_to_num(0.0)


class _Ring(torch.autograd.Function):
    @staticmethod
    def forward(ctx, red: Reducer, scale: float, causal: bool, overlap: bool, n: int, *flat):
        qs, ks, vs, pos, masks = flat[:n], flat[n:2 * n], flat[2 * n:3 * n], flat[3 * n:4 * n], flat[4 * n:]
        masks = masks if masks else [None] * n
        blocks = [(k, v, p) for k, v, p in zip(ks, vs, pos)]
        accs = [torch.zeros_like(q) for q in qs]             # sum of exp(s - m) v over the blocks so far
        maxes = [torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device) for q in qs]
        sums = [torch.zeros(q.shape[:-1], dtype=q.dtype, device=q.device) for q in qs]
        cp = red.group_size(n)   # every rank is in the lists in the simulator, one under torch.distributed
        for blocks in ring_loop(red, blocks, cp, overlap):
            for i in range(n):
                k, v, kpos = blocks[i]
                s = _scores(qs[i], k, pos[i], kpos, masks[i], scale, causal)
                m = torch.maximum(maxes[i], s.amax(-1))
                e = _exp_below(s, m.unsqueeze(-1))
                rep = qs[i].shape[1] // v.shape[1]
                o = torch.matmul(e, repeat_heads(v, rep))
                old = _exp_below(maxes[i], m)                     # rescale what earlier blocks summed
                accs[i] = accs[i] * old.unsqueeze(-1) + o
                sums[i] = sums[i] * old + e.sum(-1)
                maxes[i] = m
        # laid out as SDPA returns it ([B, L, H, E] in memory): the captured graph may view its
        # transpose without a copy, as it did SDPA's
        outs = [torch.where(d.unsqueeze(-1) > 0, a / d.clamp_min(torch.finfo(d.dtype).tiny).unsqueeze(-1), 0.0)
                .transpose(1, 2).contiguous().transpose(1, 2) for a, d in zip(accs, sums)]
        ctx.args = (red, scale, causal, overlap, n, cp, bool(flat[4 * n:]))
        ctx.save_for_backward(*qs, *ks, *vs, *pos, *(m for m in masks if m is not None), *outs, *maxes, *sums)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *douts):
        red, scale, causal, overlap, n, cp, has_mask = ctx.args
        saved = ctx.saved_tensors
        qs, ks, vs, pos = saved[:n], saved[n:2 * n], saved[2 * n:3 * n], saved[3 * n:4 * n]
        rest = saved[4 * n:]
        masks = rest[:n] if has_mask else [None] * n
        outs, maxes, sums = rest[-3 * n:-2 * n], rest[-2 * n:-n], rest[-n:]
        deltas = [(d * o).sum(-1) for d, o in zip(douts, outs)]
        dqs = [torch.zeros_like(q) for q in qs]
        blocks = [(k, v, p) for k, v, p in zip(ks, vs, pos)]
        grads = [(torch.zeros_like(k), torch.zeros_like(v)) for k, v in zip(ks, vs)]
        for blocks in ring_loop(red, blocks, cp, overlap, travelling=grads):     # dk, dv follow their block
            for i in range(n):
                k, v, kpos = blocks[i]
                hk, rep = k.shape[1], qs[i].shape[1] // k.shape[1]
                s = _scores(qs[i], k, pos[i], kpos, masks[i], scale, causal)
                p = _probs(s, maxes[i], sums[i])
                kr, vr = repeat_heads(k, rep), repeat_heads(v, rep)
                dp = torch.matmul(douts[i], vr.transpose(-1, -2))
                ds = p * (dp - deltas[i].unsqueeze(-1))
                dqs[i] = dqs[i] + torch.matmul(ds, kr) * scale
                dk, dv = grads[i]
                grads[i] = (dk + heads_to_kv(torch.matmul(ds.transpose(-1, -2), qs[i]) * scale, hk),
                            dv + heads_to_kv(torch.matmul(p.transpose(-1, -2), douts[i]), hk))
        none = (None,) * 5
        return (*none, *dqs, *(g[0] for g in grads), *(g[1] for g in grads), *(None,) * (n + (n if has_mask else 0)))


def ring_attention(red: Reducer, qs, ks, vs, positions, masks, *, scale: float, causal: bool,
                   overlap: bool = True) -> list[torch.Tensor]:
    """Every rank's attention output (lists over the ranks present). Without a mask (or with the
    causal one, checked from the positions) on CPU, the blocks run as pieces (ring_pieces.py);
    otherwise as scores with the mask's columns (this file's `_Ring`)."""
    n = len(qs)
    if masks is not None and all(_is_causal_at(m, p) for m, p in zip(masks, positions)):
        masks, causal = None, True
    if masks is None and all(q.device.type == "cpu" for q in qs):
        return ring_pieces(red, qs, ks, vs, positions, scale=scale, causal=causal, overlap=overlap)
    return list(_Ring.apply(red, scale, causal, overlap, n, *qs, *ks, *vs, *positions, *(masks or ())))


def _is_causal_at(mask: torch.Tensor, positions: torch.Tensor, rows: int = 512) -> bool:
    """True when `mask` ([.., L, S] boolean, rows at `positions`) keeps exactly key <= query position;
    compared `rows` rows at a time, so the check holds no more than rows x S booleans."""
    if mask.dtype != torch.bool or mask.dim() < 2:
        return False
    keys = torch.arange(mask.shape[-1], device=mask.device)
    for a in range(0, mask.shape[-2], rows):
        keep = keys[None, :] <= positions[a:a + rows, None]
        if not torch.equal(mask[..., a:a + rows, :], keep.expand_as(mask[..., a:a + rows, :])):
            return False
    return True


class RingAttention(ContextCollective):
    """SDPA of this rank's queries against every token's keys, the keys passed around the ring."""

    def __init__(self, handle: CommHandle, cp: int, scale: float, causal: bool, has_mask: bool, overlap: bool = True):
        super().__init__(handle, cp)
        self.scale, self.causal, self.has_mask, self.overlap = scale, causal, has_mask, overlap

    @staticmethod
    def run(red: Reducer, mods: list["RingAttention"], rank_args: list[tuple]) -> list[torch.Tensor]:
        m = mods[0]
        cols = list(zip(*rank_args))            # q, k, v, positions[, mask]: each a list over ranks
        masks = list(cols[4]) if m.has_mask else None
        return ring_attention(red, list(cols[0]), list(cols[1]), list(cols[2]), list(cols[3]), masks,
                              scale=m.scale, causal=m.causal, overlap=m.overlap)

    def extra_repr(self) -> str:
        return f"cp={self.cp}, scale={self.scale:.4g}, causal={self.causal}, mask={self.has_mask}, overlap={self.overlap}"


@dataclass(frozen=True)
class RingAttentionSpec:
    """The context-parallel pass's request for a ring attention named `module`."""

    module: str
    cp: int
    scale: float
    causal: bool
    has_mask: bool

    def build(self, handle: CommHandle) -> RingAttention:
        return RingAttention(handle, self.cp, self.scale, self.causal, self.has_mask)
