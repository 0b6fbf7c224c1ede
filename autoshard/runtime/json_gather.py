"""Gather small JSON data from every rank (checkpoint manifests, trace records) as UTF-8 bytes in
tensors, so nothing crosses the process group pickled (torch's all_gather_object unpickles what
other processes send)."""
from __future__ import annotations

import json

import torch
from autoshard.world import Group, current

__all__ = ["all_gather_json"]


def all_gather_json(obj: object, group: Group = None) -> list:
    """Every rank's `obj` (lists, dicts, numbers, strings), in rank order."""
    world = current()
    nccl = world.backend == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    data = torch.tensor(list(json.dumps(obj).encode()), dtype=torch.uint8, device=device)
    n = world.size(group)
    sizes = torch.zeros(n, dtype=torch.int64, device=device)
    world.all_gather(sizes, torch.tensor([data.numel()], device=device), group=group)
    longest = int(sizes.max())
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[: data.numel()] = data
    chunks = torch.empty(n * longest, dtype=torch.uint8, device=device)
    world.all_gather(chunks, padded, group=group)
    return [json.loads(bytes(c[: int(k)].tolist()).decode()) for c, k in zip(chunks.view(n, longest), sizes)]
