"""Where `ShardedProgram.verify` finds its check: autoshard/verify/ (the user-facing layer, which
compile may not import) registers it here when `import autoshard` imports it."""
from __future__ import annotations

from typing import Callable

from autoshard.errors import ShardingError

__all__ = ["register_verifier", "registered_verifier"]

_CHECK: list[Callable] = []


def register_verifier(check: Callable) -> None:
    """`check(prog, **options) -> Certificate` becomes `ShardedProgram.verify`."""
    _CHECK[:] = [check]


def registered_verifier() -> Callable:
    if not _CHECK:
        raise ShardingError("verify: no check is registered (import autoshard, which imports autoshard.verify)")
    return _CHECK[0]
