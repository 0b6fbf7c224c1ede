"""Dotted attribute paths on modules ("h.0.attn.c_attn.weight"): read, test, and set them."""
from __future__ import annotations

import torch
from torch import nn

__all__ = ["fetch_attr", "has_attr", "assign_attr"]


def fetch_attr(root: nn.Module, target: str):
    """The object at a dotted get_attr target ("h.0.attn.c_attn.weight") under `root`."""
    obj = root
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def has_attr(root: nn.Module, path: str) -> bool:
    """Whether `root.<path>` (dotted) exists."""
    try:
        fetch_attr(root, path)
        return True
    except AttributeError:
        return False


def assign_attr(root: nn.Module, path: str, value: object) -> None:
    """Set `root.<path>` (dotted), creating empty parent modules; tensors become parameters or buffers."""
    *mods, leaf = path.split(".")
    for m in mods:
        if not hasattr(root, m):
            root.add_module(m, nn.Module())
        root = getattr(root, m)
    if isinstance(value, nn.Parameter):
        root.register_parameter(leaf, value)
    elif isinstance(value, torch.Tensor):
        root._parameters.pop(leaf, None)
        root.register_buffer(leaf, value)
    else:
        setattr(root, leaf, value)
