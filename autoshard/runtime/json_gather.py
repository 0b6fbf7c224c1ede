"""Gather small JSON data from every rank (checkpoint manifests, trace records) as UTF-8 bytes in
tensors, so nothing crosses the process group pickled (torch's all_gather_object unpickles what
other processes send)."""
from __future__ import annotations

import json

import torch
import torch.distributed as dist

__all__ = ["all_gather_json"]


def all_gather_json(obj: object, group: dist.ProcessGroup | None = None) -> list:
    """Every rank's `obj` (lists, dicts, numbers, strings), in rank order."""
    nccl = dist.get_backend(group) == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    data = torch.tensor(list(json.dumps(obj).encode()), dtype=torch.uint8, device=device)
    sizes = [torch.zeros((), dtype=torch.int64, device=device) for _ in range(dist.get_world_size(group))]
    dist.all_gather(sizes, torch.tensor(data.numel(), device=device), group=group)
    longest = int(max(sizes))
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[: data.numel()] = data
    chunks = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in sizes]
    dist.all_gather(chunks, padded, group=group)
    return [json.loads(bytes(c[: int(n)].tolist()).decode()) for c, n in zip(chunks, sizes)]
