"""Errors autoshard raises on bad input; each message names the node, module and numbers involved."""
from __future__ import annotations

import warnings

__all__ = ["AutoshardError", "CaptureError", "ShardingError", "require_positive_int", "warn_renamed"]


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


def warn_renamed(old: str, new: str, *, stacklevel: int = 3) -> None:
    """A deprecated name was used: it still works for this release, and says what to use instead.
    The default stacklevel points at the caller of the function or property that calls this."""
    warnings.warn(f"{old} is deprecated and will be removed in the next release; use {new}", DeprecationWarning,
                  stacklevel=stacklevel)
