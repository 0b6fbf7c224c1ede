"""Which world the calling thread's rank lives in (world/__init__.py)."""
from __future__ import annotations

import contextlib
import threading
from typing import Callable, Iterator

from autoshard.world.protocol import World

__all__ = ["current", "use", "alone_with"]

_state = threading.local()
_solo: list = []
_make_solo: list[Callable[[], World]] = []


def alone_with(make: Callable[[], World]) -> None:
    """How to make the world of one rank (world/local.py registers a LocalWorld of one on import)."""
    _make_solo[:] = [make]


def current() -> World:
    """The calling thread's world: the one `use` set (a local world's rank threads), else
    torch.distributed's once a process group is initialized, else a world of one rank."""
    world = getattr(_state, "world", None)
    if world is not None:
        return world
    from autoshard.world import torch_world
    if torch_world.initialized():
        return torch_world.TorchWorld()
    if not _solo:
        _solo.append(_make_solo[0]())
    return _solo[0]


@contextlib.contextmanager
def use(world: World | None) -> Iterator[World | None]:
    """Within the block, this thread's rank lives in `world` (None: back to the default)."""
    before = getattr(_state, "world", None)
    _state.world = world
    try:
        yield world
    finally:
        _state.world = before
