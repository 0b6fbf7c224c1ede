"""Where a sharded dimension goes through view/reshape, with symbolic batch and sequence sizes.

Sizes are sympy expressions (export's SymInts expose theirs), so `s0*s1*768` and a literal
768 are compared exactly. A reshape regroups dims so that flat prefix products agree; the sharded
input dim lies in one such group, and we find the output dims of that group.
"""
from __future__ import annotations

from dataclasses import dataclass
from math import prod

import sympy
import torch

__all__ = ["to_sympy", "ReshapeMap", "map_reshape_dim"]


def to_sympy(size: int | torch.SymInt) -> sympy.Expr:
    if isinstance(size, torch.SymInt):
        return sympy.sympify(size.node.expr)
    return sympy.Integer(int(size))


@dataclass(frozen=True)
class ReshapeMap:
    """The sharded input dim `in_dim` feeds output dim `out_dim`.

    `in_inner` is the product of the input dims merged after `in_dim` in its group, `out_inner` that
    of the output dims split off after `out_dim`: index i of in_dim spans flat group positions
    [i*in_inner, (i+1)*in_inner), and index j of out_dim spans [j*out_inner, (j+1)*out_inner).
    """

    in_dim: int
    out_dim: int
    in_inner: int
    out_inner: int
    outer: int = 1        # static dims merged in front of the sharded one (tokens of a batch)
    in_size: int = 0      # the sharded dim's size (its stride in the merged dim is in_size*in_inner)


def _prefix(shape: list[sympy.Expr]) -> list[sympy.Expr]:
    out = [sympy.Integer(1)]
    for s in shape:
        out.append(sympy.expand(out[-1] * s))
    return out


def map_reshape_dim(in_shape: list[sympy.Expr], out_shape: list[sympy.Expr], dim: int,
                    *, unit_outer: bool = False) -> ReshapeMap | None:
    """The sharded dim's place after a reshape (`_by_prefix` below), or, where the leading dims
    regroup by sizes sympy cannot equate, by the suffix: when the sharded dim and every dim after it
    end the output unchanged, the reshape only regroups the dims in front of it (Mamba-2's chunked
    scan: [b, L, heads, d] -> [b, L // c, c, heads, d] with a padded, symbolic L)."""
    found = _by_prefix(in_shape, out_shape, dim, unit_outer=unit_outer)
    if found is not None:
        return found
    tail = len(in_shape) - dim
    inner = prod(in_shape[dim + 1:], start=sympy.Integer(1))
    if (tail <= len(out_shape) and list(out_shape[len(out_shape) - tail:]) == list(in_shape[dim:])
            and in_shape[dim].is_Integer and inner.is_Integer):
        return ReshapeMap(dim, len(out_shape) - tail, int(inner), int(inner), 1, int(in_shape[dim]))
    return None


def _by_prefix(in_shape: list[sympy.Expr], out_shape: list[sympy.Expr], dim: int,
               *, unit_outer: bool = False) -> ReshapeMap | None:
    """None when the sharded dim is not the outermost non-unit dim of its reshape group.

    The shard goes to the group's first non-unit output dim, or with `unit_outer` to its first
    dim even if that has size 1: [B, T, 8] -> [B, T, 1, 8] is an unsqueeze of 8 features, or one
    head of 8 (multi-query attention); only what follows tells, so the caller may ask for both.
    """
    pin, pout = _prefix(in_shape), _prefix(out_shape)
    # The group starts at the last boundary at or before `dim` that both shapes share.
    start_in = next((a for a in range(dim, -1, -1) if pin[a] in pout), None)
    if start_in is None:
        return None
    outer = prod(in_shape[start_in:dim], start=sympy.Integer(1))
    if not outer.is_Integer or not in_shape[dim].is_Integer:
        return None     # a symbolic dim merged in front of the sharded one
    start_out = pout.index(pin[start_in])
    # ... and ends at the first shared boundary past it where the product has grown (a size-1
    # sharded dim, one kv head, is merged with what follows it).
    end_in = next((b for b in range(dim + 1, len(pin)) if pin[b] in pout and pin[b] != pin[dim]), None)
    if end_in is None:
        return None
    end_out = len(pout) - 1 - pout[::-1].index(pin[end_in])
    out_dims = [j for j in range(start_out, end_out) if out_shape[j] != 1 or unit_outer]
    if not out_dims:
        return None
    j = out_dims[0]
    in_inner = prod(in_shape[dim + 1:end_in], start=sympy.Integer(1))
    out_inner = prod(out_shape[j + 1:end_out], start=sympy.Integer(1))
    if not (in_inner.is_Integer and out_inner.is_Integer):
        return None  # a symbolic size is merged with the sharded one: not a head split
    return ReshapeMap(dim, j, int(in_inner), int(out_inner), int(outer), int(in_shape[dim]))

