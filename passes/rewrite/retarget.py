"""Retarget: a graph captured from a meta-device model -> the same graph on a real device.

Export records devices literally (`arange(..., device=meta)`, `_assert_tensor_metadata(device=meta)`,
`to(device=meta)`), so a program compiled from a model built on the meta device would still create
its tensors there. This pass replaces every meta device in node arguments, in nested graphs too
(higher-order ops such as `wrap_with_set_grad_enabled` keep theirs in submodules).

Export also follows the model's device-dependent branches with the meta device, which counts as
"not the CPU": Hugging Face's grouped-mm experts count tokens per expert with `histc` on int32
there, which the CPU kernel refuses ('"histc_cpu" not implemented for 'Int''). On the CPU every
histc becomes `histc_on_cpu`: an integer input is counted in float32 and cast back (counts are
exact in float32 below 2**24).
"""
from __future__ import annotations

import torch
import torch.fx as fx

__all__ = ["histc_on_cpu", "retarget_device", "retarget_nodes"]

_META = torch.device("meta")


def retarget_device(gm: fx.GraphModule, device: torch.device | str, source: torch.device | str = _META) -> int:
    """Replace the `source` device (the meta device unless given) by `device` in `gm` and its nested
    graph modules, in place; returns the number of nodes changed."""
    device = torch.device(device)
    changed = retarget_nodes(gm.graph, device, source)
    if device.type == "cpu":
        changed += _histc_in_float(gm)
    for sub in gm.modules():
        if sub is not gm and isinstance(sub, fx.GraphModule):
            changed += retarget_device(sub, device, source)
    if changed:
        gm.graph.lint()
        gm.recompile()
    return changed



def retarget_nodes(graph: fx.Graph, device: torch.device | str, source: torch.device | str = _META) -> int:
    """The `source` device replaced by `device` in the arguments of `graph`'s own nodes (a rank
    graph whose passes added nodes after its captured graph was retargeted); returns how many."""
    device, source = torch.device(device), torch.device(source)
    swap = lambda a: device if isinstance(a, torch.device) and a == source else a   # noqa: E731
    changed = 0
    for n in graph.nodes:
        args, kwargs = fx.node.map_aggregate(n.args, swap), fx.node.map_aggregate(n.kwargs, swap)
        if args != n.args or kwargs != n.kwargs:
            n.args, n.kwargs = args, kwargs
            changed += 1
    return changed


def histc_on_cpu(x: torch.Tensor, bins: int = 100, lo: float = 0, hi: float = 0) -> torch.Tensor:
    """torch.histc, integer inputs counted in float32 and returned in their own dtype."""
    if x.is_floating_point():
        return torch.histc(x, bins, lo, hi)
    return torch.histc(x.float(), bins, lo, hi).to(x.dtype)


def _histc_in_float(gm: fx.GraphModule) -> int:
    """Every histc -> histc_on_cpu (rank graphs carry no dtypes to decide it here)."""
    changed = 0
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is torch.ops.aten.histc.default:
            n.target = histc_on_cpu
            changed += 1
    return changed
