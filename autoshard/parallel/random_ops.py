"""The ops that draw random numbers, and where each takes its probability, train flag and seed.

The one list of random ops: the rewrite asks it which nodes draw (each then runs under its RNG
region's generator, rng.py), the fusion pass asks it for the fused op it builds, and the region's
module reads from it how to turn the op off in eval mode and where to pass a seed.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["RandomOp", "RANDOM_OPS", "draws_randomly"]


@dataclass(frozen=True)
class RandomOp:
    """p: (position, keyword) of the drop probability. train: those of a train flag, if the op has
    one (eval mode sets it False; without one, eval mode sets p to 0). seed: the position of a seed
    argument, for ops that take their randomness as a seed instead of from torch's generator."""

    p: tuple[int, str]
    train: tuple[int, str] | None = None
    seed: int | None = None

    def off(self) -> tuple[int, str, object]:
        """(position, keyword, value) that makes the op draw nothing."""
        return (*self.train, False) if self.train else (*self.p, 0.0)


RANDOM_OPS: dict[str, RandomOp] = {          # op's short name (aten's, or torch.ops.autoshard's)
    "dropout": RandomOp(p=(1, "p"), train=(2, "train")),
    "native_dropout": RandomOp(p=(1, "p"), train=(2, "train")),
    "scaled_dot_product_attention": RandomOp(p=(4, "dropout_p")),
    "bias_dropout_add": RandomOp(p=(3, "p"), seed=4),
}


def _arg(args: tuple, kwargs: dict, where: tuple[int, str], default: object) -> object:
    pos, key = where
    return args[pos] if len(args) > pos else kwargs.get(key, default)


def draws_randomly(name: str, args: tuple, kwargs: dict) -> bool:
    """Whether a call of the op named `name` with these arguments draws random numbers."""
    op = RANDOM_OPS.get(name)
    if op is None:
        return False
    train = _arg(args, kwargs, op.train, True) if op.train else True
    return bool(train) and _arg(args, kwargs, op.p, 0.0) != 0
