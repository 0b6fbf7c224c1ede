"""Errors autoshard raises on bad input; each message names the node, module and numbers involved."""
from __future__ import annotations

__all__ = ["AutoshardError", "CaptureError", "ShardingError"]


class AutoshardError(Exception):
    """Base class of autoshard's errors."""


class CaptureError(AutoshardError):
    """The model could not be traced into a graph (the tracer's own reason is chained)."""


class ShardingError(AutoshardError, ValueError):
    """The requested parallelism cannot be applied to this model as asked."""
