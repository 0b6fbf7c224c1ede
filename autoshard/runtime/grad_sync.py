"""Gradient synchronisation after a pipeline step, and clipping by the global gradient norm.

Order (`sync_grads`): (1) parameters held by several pipeline ranks (a tied embedding on the first and
last stage) sum their gradients over those ranks; (2) every gradient is averaged over the
data-parallel group in flat buckets (one all-reduce per bucket, as DDP does), an expert's (ep > 1)
over the data-parallel ranks holding the same experts instead; (3) optionally, gradients are clipped by
the norm of the full model's gradient, each element counted once however many ranks hold it.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from autoshard.runtime.mesh import MeshGroups, ParallelDims

__all__ = ["all_reduce_buckets", "sync_grads", "global_grad_norm", "clip_grads"]


def sync_grads(params: dict[str, torch.Tensor], groups: MeshGroups, shared_params: dict[tuple[int, ...], list[str]],
               expert_params: set[str], dp_scale: float) -> None:
    """Steps (1) and (2) above for this rank's `params` (missing gradients become zeros)."""
    for p in params.values():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    for pps, group in groups.shared.items():     # tied weights: sum the stages' parts
        for name in shared_params.get(pps, []):
            if name in params:
                dist.all_reduce(params[name].grad, group=group)
    if groups.dims.dp > 1:
        all_reduce_buckets([p.grad for name, p in params.items() if name not in expert_params], groups.dp, dp_scale)
        experts = [p.grad for name, p in params.items() if name in expert_params]
        if experts:
            all_reduce_buckets(experts, groups.expert_dp, dp_scale)


def all_reduce_buckets(grads: list[torch.Tensor], group: dist.ProcessGroup | None, scale: float,
                       bucket_bytes: int = 25 * 2 ** 20) -> int:
    """Sum `grads` in place over `group` and multiply by `scale`, in buckets of at most
    `bucket_bytes` (a larger tensor is a bucket of its own). Returns the number of all-reduces."""
    calls, bucket, size = 0, [], 0
    for g in grads + [None]:
        if g is not None and (not bucket or (size + g.numel() * g.element_size() <= bucket_bytes
                                             and g.dtype == bucket[0].dtype)):
            bucket.append(g)
            size += g.numel() * g.element_size()
            continue
        if bucket:
            flat = torch.cat([b.reshape(-1) for b in bucket])
            dist.all_reduce(flat, group=group)
            flat.mul_(scale)
            offset = 0
            for b in bucket:
                b.copy_(flat[offset: offset + b.numel()].view_as(b))
                offset += b.numel()
            calls += 1
        bucket, size = ([g], g.numel() * g.element_size()) if g is not None else ([], 0)
    return calls


def global_grad_norm(weighted: list[tuple[torch.Tensor, torch.Tensor | float]], dims: ParallelDims,
                     replicas: int | None = None) -> torch.Tensor:
    """L2 norm of the whole model's gradient. `weighted` pairs each local gradient with the share
    of it this rank counts: 1 / (number of ranks holding it) per element or row, broadcastable.
    Data-parallel replicas hold equal gradients after the all-reduce, so the world sum is divided by
    `replicas` (default dp; 1 when each dp rank holds a disjoint shard, as the distributed optimizer's)."""
    replicas = dims.dp if replicas is None else replicas
    device = weighted[0][0].device if weighted else None
    total = torch.zeros((), dtype=torch.float64, device=device)
    for g, w in weighted:
        w = w.to(device) if isinstance(w, torch.Tensor) else w
        total += (g.detach().double().pow(2) * w).sum()
    if dist.is_initialized():
        dist.all_reduce(total)
    return (total / replicas).sqrt()


def clip_grads(grads: list[torch.Tensor], norm: torch.Tensor, max_norm: float) -> None:
    """Scale gradients so their global norm is at most `max_norm` (torch.nn.utils.clip_grad_norm_'s rule)."""
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef.to(g.dtype))
