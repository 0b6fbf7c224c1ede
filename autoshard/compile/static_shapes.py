"""Sequence-length expressions for a graph exported with static sizes: context parallelism together
with sequence parallelism.

Sequence parallelism cuts the sequence by index, so its graphs are exported with every size static
(compile/capture.py). The context-parallel pass reads which dims are the sequence's tokens from
sizes written in the sequence length S (passes/context/split.py), which a static graph no longer
shows: a dim of 16 may be 16 tokens or 16 channels. So the model is exported a second time, static
at another length, and the two graphs are read side by side, node by node: a size that differs
between them is a token size, a + b * S fitted through the two points; a size that does not is a
constant. The twin's graph must be the same ops in the same order (a model whose graph changes with
the length is refused, naming the first node that differs).

    shapes = symbolic_shapes(first.gm, twin.gm, seq, twin_seq)     # captured node name -> exprs
"""
from __future__ import annotations

import sympy
import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from autoshard.errors import ShardingError

__all__ = ["SEQ", "sequence_length", "twin_length", "with_length", "symbolic_shapes"]

SEQ = sympy.Symbol("S", integer=True, positive=True)      # the sequence length in the static graphs' shapes


def sequence_length(named: dict[str, object]) -> int:
    """The example's sequence length: dim 1 of the first integer input of two or more dims (the ids)."""
    for v in pytree.tree_leaves(named):
        if isinstance(v, torch.Tensor) and v.dim() >= 2 and not v.is_floating_point():
            return int(v.shape[1])
    raise ShardingError("the model has no token-id input ([batch, sequence] integers) to read the sequence length from")


def twin_length(seq: int, step: int) -> int:
    """Another length the program could run at (a multiple of `step` apart): shorter where one fits,
    so that the twin stays within the model's position tables."""
    return seq - step if seq - step >= step else seq + step


def with_length(named: dict[str, object], seq: int, new: int) -> dict[str, object]:
    """The example inputs at `new` tokens: every dim after the batch whose size is `seq` cut, or
    extended by repeating its values."""
    def resize(v):
        if not isinstance(v, torch.Tensor) or v.dim() < 2:
            return v
        for d in range(1, v.dim()):
            if v.shape[d] == seq:
                reps = -(-new // seq)
                v = v.repeat(*[reps if i == d else 1 for i in range(v.dim())]).narrow(d, 0, new)
        return v.contiguous()
    return pytree.tree_map(resize, named)


def symbolic_shapes(gm: fx.GraphModule, twin: fx.GraphModule, seq: int, twin_seq: int) -> dict[str, object]:
    """Captured node name -> its value's sizes as expressions in SEQ (a list of lists for a tuple)."""
    nodes, twins = list(gm.graph.nodes), list(twin.graph.nodes)
    for a, b in zip(nodes, twins):
        if a.op != b.op or a.target != b.target:
            raise ShardingError(f"cp with sequence_parallel=True: the model's graph changes with the sequence length "
                                f"(node {a.name}: {a.target} at {seq} tokens, {b.target} at {twin_seq}); context "
                                "parallelism cannot tell its token dims")
    if len(nodes) != len(twins):
        raise ShardingError(f"cp with sequence_parallel=True: the model's graph has {len(nodes)} nodes at {seq} tokens "
                            f"and {len(twins)} at {twin_seq}; context parallelism cannot tell its token dims")
    out = {}
    for a, b in zip(nodes, twins):
        va, vb = a.meta.get("val"), b.meta.get("val")
        if isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor):
            out[a.name] = _fit(va.shape, vb.shape, seq, twin_seq)
        elif isinstance(va, (tuple, list)) and isinstance(vb, (tuple, list)) and len(va) == len(vb) and \
                all(isinstance(x, torch.Tensor) for x in (*va, *vb)):
            out[a.name] = [_fit(x.shape, y.shape, seq, twin_seq) for x, y in zip(va, vb)]
    return out


def _fit(sizes: torch.Size, twin_sizes: torch.Size, seq: int, twin_seq: int) -> list[sympy.Expr]:
    """Each size as a + b * SEQ through (seq, size) and (twin_seq, twin size)."""
    out = []
    for x, y in zip(sizes, twin_sizes):
        x, y = int(x), int(y)
        slope = sympy.Rational(y - x, twin_seq - seq)
        out.append(sympy.Integer(x) if x == y else sympy.expand(slope * SEQ + (x - slope * seq)))
    return out
