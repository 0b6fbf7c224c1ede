"""Expert parallelism's collective: tokens sent to the ranks that own their experts and back.

    out = dispatch_combine(x, idx, w, run_local, ep)        # x [n, H], idx / w [n, k] -> out [n, H]

`ep` (an `ExpertGroup`) holds the expert-parallel process group, this rank's place in it and how
many experts each rank owns (owner of expert e: e // per_rank). Each of the n * k (token, slot)
pairs goes to its expert's owner with one all-to-all of uneven splits (dropless: every pair is
sent, however unbalanced the routing); the owner runs `run_local(x_recv [m, H], local ids [m, 1],
weights [m, 1])` (the model's own experts module on its local experts) and a second all-to-all
brings each result back to the pair's rank, where the k results of a token are summed.

`AllToAll` is the autograd function: its backward is the same exchange with the splits swapped. It
counts the bytes this rank sends to other ranks (`ExpertGroup.sent_bytes`, forward and backward).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

__all__ = ["ExpertGroup", "AllToAll", "dispatch_combine"]


@dataclass
class ExpertGroup:
    """The expert-parallel group of one rank: `size` ranks, this one `rank`, each owning
    `per_rank` consecutive experts; `sent_bytes` counts payload this rank sent to the others."""

    group: dist.ProcessGroup | None
    rank: int
    size: int
    per_rank: int
    sent_bytes: int = 0

    def _exchange(self, t: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        """Rows send[j] of `t` (in order) go to rank j; returns the rows received, rank by rank."""
        t = t.contiguous()
        if self.size == 1:          # a group of one (the in-process check): nothing leaves the rank
            return t.clone()
        out = t.new_empty((sum(recv), *t.shape[1:]))
        dist.all_to_all_single(out, t, output_split_sizes=recv, input_split_sizes=send, group=self.group)
        row = t[0].numel() * t.element_size() if t.dim() > 1 else t.element_size()
        self.sent_bytes += row * (sum(send) - send[self.rank])
        return out


class AllToAll(torch.autograd.Function):
    """Rows of x exchanged over the expert-parallel group (send / recv: rows per rank)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, ep: ExpertGroup, send: list[int], recv: list[int]) -> torch.Tensor:
        ctx.args = (ep, send, recv)
        return ep._exchange(x, send, recv)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ep, send, recv = ctx.args
        return ep._exchange(grad, recv, send), None, None, None


def dispatch_combine(x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor,
                     run_local: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
                     ep: ExpertGroup) -> torch.Tensor:
    """The experts' output for the tokens of this rank, computed by the experts' owners (see above)."""
    n, k = idx.shape
    flat = idx.reshape(-1)                                   # [n * k] expert of each (token, slot)
    owner = torch.div(flat, ep.per_rank, rounding_mode="floor")
    order = torch.argsort(owner, stable=True)                # pairs grouped by owner rank
    rows = torch.div(order, k, rounding_mode="floor")         # the token of each sent pair
    send = torch.bincount(owner, minlength=ep.size)                          # [ep] pairs per owner
    ones = [1] * ep.size
    send_l, recv_l = send.tolist(), ep._exchange(send, ones, ones).tolist()
    local_ids = ep._exchange((flat - owner * ep.per_rank)[order], send_l, recv_l)     # [m] no gradient
    x_in = AllToAll.apply(x[rows], ep, send_l, recv_l)                               # [m, H]
    w_in = AllToAll.apply(w.reshape(-1)[order], ep, send_l, recv_l)                  # [m]
    y = run_local(x_in, local_ids[:, None], w_in[:, None])                           # [m, H] weighted
    back = AllToAll.apply(y, ep, recv_l, send_l)                                     # [n * k, H], `order`'s order
    return torch.zeros((n, x.shape[-1]), dtype=back.dtype, device=back.device).index_add(0, rows, back)
