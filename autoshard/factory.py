"""`module:callable` specs of the command lines: the user's model factory, loaded with a one-line
error naming the spec (never a traceback)."""
from __future__ import annotations

import importlib
import os
import sys
from typing import Callable

__all__ = ["load_factory"]


def load_factory(spec: str, command: str) -> Callable[[], object]:
    """The callable `spec` names; SystemExit with `command`'s name and the reason if it cannot."""
    module, _, name = spec.partition(":")
    if os.getcwd() not in sys.path:         # as `python -m` would: the user's modules next to them
        sys.path.insert(0, os.getcwd())
    if not module or not name:
        raise SystemExit(f"{command}: expected module:callable, got {spec!r}")
    try:
        found = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise SystemExit(f"{command}: cannot load {spec!r}: {e}") from None
    if not callable(found):
        raise SystemExit(f"{command}: {spec!r} is a {type(found).__name__}, not a callable returning the model")
    return found
