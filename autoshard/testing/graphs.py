"""What a rank or stage graph holds, for the tests and checks: its fused ops."""
from __future__ import annotations

import torch.fx as fx

__all__ = ["fused_ops"]


def fused_ops(gm: fx.GraphModule) -> list[str]:
    """The rule name of each op the fusion pass inserted (passes/fusion/fuse.py marks it meta["fused"]); a
    stage's input received from the previous stage carries its sender's meta and is not counted."""
    return [n.meta["fused"] for n in gm.graph.nodes if "fused" in n.meta and n.op in ("call_function", "call_module")]
