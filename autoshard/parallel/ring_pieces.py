"""Ring attention in pieces: the causal (or unmasked) ring with a fused attention per piece pair.

A rank's tokens are two pieces of S / (2 cp) consecutive positions (parallel/context_parallel.py),
and so is every key/value block it receives. Under a causal mask a (query piece, key piece) pair is
one of three kinds: keys all before the queries (attend to all), the same positions (the causal
square: SDPA's own is_causal), or keys all after (nothing: skipped, which is where the load-balanced
layout halves the work). Each pair runs torch's fused CPU attention, which returns the pair's
output and log-sum-exp without holding its scores; pairs merge by their log-sum-exp. Backward
calls the fused backward per pair with the merged output and log-sum-exp (each pair's share of the
softmax is exp(scores - lse)), dq accumulating on the rank and dk / dv on the travelling block.
Memory per step: O(S / cp) (no [L, L] scores). Without `causal`, every pair attends to all.
"""
from __future__ import annotations

import torch

from autoshard.parallel.comm import Reducer
from autoshard.parallel.ring_steps import ring_loop

__all__ = ["ring_pieces", "repeat_heads", "heads_to_kv"]

aten = torch.ops.aten
_FULL, _DIAGONAL = "full", "diagonal"


def _pairs(qpos: torch.Tensor, kpos: torch.Tensor, causal: bool) -> list[tuple[slice, slice, str]]:
    """(query piece, key piece, kind) of every pair that sees a key."""
    c = qpos.shape[0] // 2
    pieces = [slice(0, c), slice(c, 2 * c)]
    out = []
    for qi in pieces:
        for kj in pieces:
            q0, k0 = int(qpos[qi.start]), int(kpos[kj.start])
            if not causal or k0 < q0:
                out.append((qi, kj, _FULL))
            elif k0 == q0:
                out.append((qi, kj, _DIAGONAL))
    return out


def repeat_heads(x: torch.Tensor, rep: int) -> torch.Tensor:
    """[B, Hk, L, E] -> [B, Hk * rep, L, E]: each key/value head for the `rep` query heads it serves."""
    return x.repeat_interleave(rep, dim=1) if rep > 1 else x


def heads_to_kv(x: torch.Tensor, hk: int) -> torch.Tensor:
    """[B, H, L, E] summed over the query heads sharing each key/value head -> [B, Hk, L, E]."""
    b, h, l, e = x.shape
    return x if h == hk else x.view(b, hk, h // hk, l, e).sum(2)


def _piece(x: torch.Tensor, s: slice) -> torch.Tensor:
    return x[:, :, s].contiguous()


class _RingPieces(torch.autograd.Function):
    @staticmethod
    def forward(ctx, red: Reducer, scale: float, causal: bool, overlap: bool, n: int, *flat):
        qs, ks, vs, pos = flat[:n], flat[n:2 * n], flat[2 * n:3 * n], flat[3 * n:]
        cp = red.group_size(n)
        outs = [torch.zeros_like(q) for q in qs]
        # log-sum-exps in float32 (the fused op's for half types), float64 for float64 (its backward takes no other)
        lses = [torch.full(q.shape[:-1], float("-inf"), dtype=torch.promote_types(q.dtype, torch.float32),
                           device=q.device) for q in qs]
        blocks = list(zip(ks, vs, pos))
        for blocks in ring_loop(red, blocks, cp, overlap):
            for i in range(n):
                k, v, kpos = blocks[i]
                rep = qs[i].shape[1] // k.shape[1]
                for qi, kj, kind in _pairs(pos[i], kpos, causal):
                    o, lse = aten._scaled_dot_product_flash_attention_for_cpu(
                        _piece(qs[i], qi), repeat_heads(_piece(k, kj), rep), repeat_heads(_piece(v, kj), rep), 0.0,
                        kind == _DIAGONAL, scale=scale)
                    old = lses[i][:, :, qi]
                    new = torch.logaddexp(old, lse)
                    outs[i][:, :, qi] = (outs[i][:, :, qi] * torch.exp(old - new).unsqueeze(-1).to(o.dtype)
                                         + o * torch.exp(lse - new).unsqueeze(-1).to(o.dtype))
                    lses[i][:, :, qi] = new
        ctx.args = (red, scale, causal, overlap, n, cp)
        ctx.save_for_backward(*qs, *ks, *vs, *pos, *outs, *lses)
        # laid out as SDPA returns it ([B, L, H, E] in memory): the captured graph may view its transpose
        return tuple(o.transpose(1, 2).contiguous().transpose(1, 2) for o in outs)

    @staticmethod
    def backward(ctx, *douts):
        red, scale, causal, overlap, n, cp = ctx.args
        saved = ctx.saved_tensors
        qs, ks, vs, pos = saved[:n], saved[n:2 * n], saved[2 * n:3 * n], saved[3 * n:4 * n]
        outs, lses = saved[4 * n:5 * n], saved[5 * n:]
        dqs = [torch.zeros_like(q) for q in qs]
        blocks = list(zip(ks, vs, pos))
        grads = [(torch.zeros_like(k), torch.zeros_like(v)) for k, v in zip(ks, vs)]
        for blocks in ring_loop(red, blocks, cp, overlap, travelling=grads):     # dk, dv follow their block
            for i in range(n):
                k, v, kpos = blocks[i]
                hk, rep = k.shape[1], qs[i].shape[1] // k.shape[1]
                dk, dv = (g.clone() for g in grads[i])
                for qi, kj, kind in _pairs(pos[i], kpos, causal):
                    gq, gk, gv = aten._scaled_dot_product_flash_attention_for_cpu_backward(
                        _piece(douts[i], qi), _piece(qs[i], qi), repeat_heads(_piece(k, kj), rep),
                        repeat_heads(_piece(v, kj), rep), _piece(outs[i], qi), lses[i][:, :, qi].contiguous(), 0.0,
                        kind == _DIAGONAL, scale=scale)
                    dqs[i][:, :, qi] += gq
                    dk[:, :, kj] += heads_to_kv(gk, hk)
                    dv[:, :, kj] += heads_to_kv(gv, hk)
                grads[i] = (dk, dv)
        return (*(None,) * 5, *dqs, *(g[0] for g in grads), *(g[1] for g in grads), *(None,) * n)


def ring_pieces(red: Reducer, qs, ks, vs, positions, *, scale: float, causal: bool,
                overlap: bool = True) -> list[torch.Tensor]:
    n = len(qs)
    return list(_RingPieces.apply(red, scale, causal, overlap, n, *qs, *ks, *vs, *positions))
