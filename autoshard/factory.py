"""What the command lines share: the user's model factory from a `module:callable` spec, and
errors as one line naming the command (never a traceback unless asked)."""
from __future__ import annotations

import importlib
import os
import sys
from contextlib import contextmanager
from typing import Callable

__all__ = ["load_factory", "one_line_errors"]


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


@contextmanager
def one_line_errors(command: str, debug: bool):
    """An error in the block exits with one line naming the command and the reason; `debug`
    lets the traceback through."""
    try:
        yield
    except Exception as e:
        if debug:
            raise
        text = str(e).strip()
        raise SystemExit(f"{command}: {type(e).__name__}: {text.splitlines()[0] if text else ''} "
                         f"(--debug shows the traceback)") from None
