"""Errors autoshard raises on bad input; each message names the node, module and numbers involved."""
from __future__ import annotations


__all__ = ["AutoshardError", "CaptureError", "ShardingError", "expert_split_problem", "require_positive_int"]


class AutoshardError(Exception):
    """Base class of autoshard's errors."""


class CaptureError(AutoshardError):
    """The model could not be traced into a graph (the tracer's own reason is chained)."""


class ShardingError(AutoshardError, ValueError):
    """The requested parallelism cannot be applied to this model as asked."""


def require_positive_int(name: str, value: object) -> int:
    """`value` if it is a positive int (not a bool), else a ShardingError naming it."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ShardingError(f"{name} must be a positive integer, got {value!r}")
    return value


def expert_split_problem(dp: int, ep: int, experts: int | None = None, cp: int = 1) -> str | None:
    """Why `ep` cannot split the dp x cp ranks of the data-parallel axis (and `experts` experts, when
    given) into expert-parallel groups, or None when it can; each caller raises it as its own kind of
    error."""
    if dp * cp % ep:
        if cp == 1:
            return f"ep={ep} must divide dp={dp}: expert-parallel groups are made of data-parallel ranks"
        return (f"ep={ep} must divide dp x cp = {dp} x {cp} = {dp * cp}: expert-parallel groups are made of "
                "the data-parallel axis's ranks")
    if experts is not None and experts % ep:
        return f"ep={ep} must divide the {experts} experts of each MoE layer"
    return None
