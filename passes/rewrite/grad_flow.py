"""Which nodes of a captured graph can carry a gradient (the rewrite puts f only where one flows)."""
from __future__ import annotations

from typing import Callable

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

__all__ = ["grad_flow"]


def grad_flow(gm: fx.GraphModule) -> Callable[[fx.Node], bool]:
    """Which nodes can carry a gradient: from trainable parameters and floating-point inputs.

    A node whose value is a list or tuple (split, chunk, unbind, a multi-output op) carries one
    when any floating-point tensor in it does: its getitems pass that gradient on."""
    memo: dict[fx.Node, bool] = {}

    def needs(n: fx.Node) -> bool:
        if n not in memo:
            floating = any(isinstance(v, torch.Tensor) and v.is_floating_point()
                           for v in pytree.tree_leaves(n.meta.get("val")))
            if n.op == "get_attr":
                obj = gm
                for part in n.target.split("."):
                    obj = getattr(obj, part)
                memo[n] = isinstance(obj, torch.nn.Parameter) and obj.requires_grad
            elif n.op == "placeholder":
                memo[n] = floating
            else:
                memo[n] = floating and any(needs(a) for a in n.all_input_nodes)
        return memo[n]

    for n in gm.graph.nodes:     # in order, so the recursion stays shallow
        needs(n)
    return needs
