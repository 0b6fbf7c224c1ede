"""Names that moved in 0.2's layout, kept for one release: each use warns and names the new place."""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from typing import Callable

from autoshard.errors import warn_renamed

__all__ = ["MOVED_MODULES", "install_moved_modules", "renamed_attribute", "moved_names"]

MOVED_MODULES = {       # old module -> new module
    "autoshard.capture": "autoshard.compile.capture",
    "autoshard.program": "autoshard.compile.program",
    "autoshard.rank": "autoshard.compile.rank",
    "autoshard.simulate": "autoshard.compile.simulate",
    "autoshard.weights": "autoshard.compile.weights",
    "autoshard.new_signature": "autoshard.compile.new_signature",
    "autoshard.collectives": "autoshard.parallel.tensor_parallel",
    "autoshard.sequence_parallel": "autoshard.parallel.sequence_parallel",
    "autoshard.vocab_parallel": "autoshard.parallel.vocab_parallel",
    "autoshard.rng": "autoshard.parallel.rng",
    "autoshard.mesh": "autoshard.runtime.mesh",
    "autoshard.p2p": "autoshard.runtime.p2p",
    "autoshard.grad_sync": "autoshard.runtime.grad_sync",
    "autoshard.schedules": "autoshard.runtime.schedules",
    "autoshard.pipeline": "autoshard.runtime.executor",
    "autoshard.trace": "autoshard.runtime.trace",
    "autoshard.loss_tokens": "autoshard.runtime.loss_tokens",
    "autoshard.json_gather": "autoshard.runtime.json_gather",
    "autoshard.costmodel": "autoshard.planning.costmodel",
    "autoshard.cost_formulas": "autoshard.planning.cost_formulas",
    "autoshard.kernel_cost": "autoshard.planning.gemm_timing",
    "autoshard.hardware": "autoshard.planning.hardware",
    "autoshard.planner": "autoshard.planning.planner",
    "autoshard.checkpoint_index": "autoshard.checkpoint.index",
    "autoshard.checkpoint_convert": "autoshard.checkpoint.convert",
    "autoshard.materialize": "autoshard.checkpoint.materialize",
    "autoshard.passes.annotate": "autoshard.passes.sharding.annotate",
    "autoshard.passes.index_sets": "autoshard.passes.sharding.index_sets",
    "autoshard.passes.placement": "autoshard.passes.sharding.placement",
    "autoshard.passes.partition": "autoshard.passes.stages",
    "autoshard.passes.fuse": "autoshard.passes.fusion.fuse",
    "autoshard.passes.fuse_rules": "autoshard.passes.fusion.rules",
}


class _MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports an old module path as its new module (the same module object), with a warning."""

    def find_spec(self, name, path=None, target=None):
        if name in MOVED_MODULES:
            return importlib.util.spec_from_loader(name, self)
        return None

    def create_module(self, spec):
        new = MOVED_MODULES[spec.name]
        warn_renamed(spec.name, new, stacklevel=2)
        return importlib.import_module(new)

    def exec_module(self, module) -> None:
        pass


def install_moved_modules() -> None:
    if not any(isinstance(f, _MovedModuleFinder) for f in sys.meta_path):
        sys.meta_path.append(_MovedModuleFinder())


def renamed_attribute(module: str, renames: dict[str, tuple[str, object]]) -> Callable[[str], object]:
    """A module `__getattr__` serving old attribute names: old -> (new name, object)."""
    def __getattr__(name: str) -> object:
        if name in renames:
            new, obj = renames[name]
            warn_renamed(f"{module}.{name}", f"{module}.{new}")
            return obj
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    return __getattr__


def moved_names(module: str, homes: dict[str, str]) -> Callable[[str], object]:
    """A module `__getattr__` serving names that moved to other modules: name -> its new module."""
    def __getattr__(name: str) -> object:
        if name in homes:
            warn_renamed(f"{module}.{name}", f"{homes[name]}.{name}")
            return getattr(importlib.import_module(homes[name]), name)
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    return __getattr__
