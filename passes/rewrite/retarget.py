"""Retarget: a graph captured from a meta-device model -> the same graph on a real device.

Export records devices literally (`arange(..., device=meta)`, `_assert_tensor_metadata(device=meta)`,
`to(device=meta)`), so a program compiled from a model built on the meta device would still create
its tensors there. This pass replaces every meta device in node arguments, in nested graphs too
(higher-order ops such as `wrap_with_set_grad_enabled` keep theirs in submodules).
"""
from __future__ import annotations

import torch
import torch.fx as fx

__all__ = ["retarget_device"]

_META = torch.device("meta")


def retarget_device(gm: fx.GraphModule, device: torch.device | str) -> int:
    """Replace the meta device by `device` in `gm` and its nested graph modules, in place; returns
    the number of nodes changed."""
    device = torch.device(device)
    swap = lambda a: device if isinstance(a, torch.device) and a == _META else a   # noqa: E731
    changed = 0
    for n in gm.graph.nodes:
        args, kwargs = fx.node.map_aggregate(n.args, swap), fx.node.map_aggregate(n.kwargs, swap)
        if args != n.args or kwargs != n.kwargs:
            n.args, n.kwargs = args, kwargs
            changed += 1
    for sub in gm.modules():
        if sub is not gm and isinstance(sub, fx.GraphModule):
            changed += retarget_device(sub, device)
    if changed:
        gm.graph.lint()
        gm.recompile()
    return changed
