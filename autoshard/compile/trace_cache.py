"""Reuse of torch.export traces within one process, opt-in (`AUTOSHARD_TRACE_CACHE=1`).

Exporting is most of what `autoshard()` costs (2-3 s for an 8-layer GPT-2 on one core), and a
process that compiles the same architecture again (another mesh, another optimizer, a fresh copy of
the same model; the test suite does this hundreds of times) traces the same graph again. With the
switch on, `capture` keeps each successful export under a key of everything the trace reads and
hands a later call with an equal key the kept program, bound to the new model's own parameters,
buffers and tensor attributes (`bind`); a deep copy of the graph is made per use by
`ExportedProgram.module()`, so callers never share a graph.

The key (`trace_key`): every submodule's class (by identity, held by the key so that its id cannot
be reused while the trace is kept), mode, hooks and plain attributes
(numbers, strings, flags, configs such as a Hugging Face `PretrainedConfig`, compared by value);
every parameter's and buffer's name, shape, dtype, device, requires_grad and which names share one
tensor (tied weights) (values are not: export traces them as fake tensors, and a branch on one
cannot trace); the example inputs' structure, shapes, dtypes and constants; and the
capture's options, autocast, grad mode and inference mode. A model with global module hooks is never
cached. What it cannot see: a forward that reads state outside the model (a global, a
monkeypatched function). That is why it is off unless asked for.
"""
from __future__ import annotations

import copy
import os
from collections import OrderedDict
from typing import Hashable

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.export import ExportedProgram
from torch.nn.modules import module as module_hooks

__all__ = ["ENV", "bind", "clear", "enabled", "lookup", "stats", "store", "trace_key"]

ENV = "AUTOSHARD_TRACE_CACHE"
_KEEP = 64                                   # traces kept, least recently used dropped first
_CACHE: OrderedDict[Hashable, ExportedProgram] = OrderedDict()
_STATS = {"hits": 0, "misses": 0}
_MODULE_FIELDS = {"_parameters", "_buffers", "_modules", "_non_persistent_buffers_set", "training",
                  "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
                  "_load_state_dict_post_hooks", "_backward_hooks", "_backward_pre_hooks",
                  "_forward_hooks", "_forward_pre_hooks", "_forward_hooks_with_kwargs",
                  "_forward_hooks_always_called", "_forward_pre_hooks_with_kwargs", "_is_full_backward_hook"}


class _Same:
    """An object compared by identity, held: a key that names a class, function or hook keeps it
    alive, so its id cannot be reused by another object while the trace is kept."""
    __slots__ = ("obj",)

    def __init__(self, obj: object):
        self.obj = obj

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Same) and other.obj is self.obj

    def __hash__(self) -> int:
        return id(self.obj)


def enabled() -> bool:
    return os.environ.get(ENV, "") not in ("", "0")


def _value(x: object, depth: int = 0) -> Hashable:
    """A comparable picture of a plain attribute's value; objects by their fields, a few levels deep."""
    if x is None or isinstance(x, (bool, int, float, str, bytes, torch.dtype, torch.device)):
        return (type(x).__name__, x)
    if isinstance(x, (tuple, list)):
        return (type(x).__name__, tuple(_value(v, depth + 1) for v in x))
    if isinstance(x, (set, frozenset)):
        return (type(x).__name__, tuple(sorted(repr(_value(v, depth + 1)) for v in x)))
    if isinstance(x, dict):
        return ("dict", tuple(sorted((repr(k), _value(v, depth + 1)) for k, v in x.items())))
    if isinstance(x, torch.Tensor):       # traced as a fake tensor: its values cannot steer the trace
        return ("tensor", tuple(x.shape), x.dtype, x.device.type)
    if isinstance(x, nn.Module):
        return ("module", _Same(x))
    if depth < 4 and hasattr(x, "__dict__") and not callable(x):
        return (_Same(type(x)), _value(vars(x), depth + 1))
    return ("object", _Same(x))               # functions, classes, anything else: the same object only


def _module_part(name: str, m: nn.Module) -> Hashable:
    hooks = tuple(_Same(h) for d in (m._forward_hooks, m._forward_pre_hooks, m._backward_hooks,
                                       m._backward_pre_hooks) for h in d.values())
    attrs = tuple(sorted((k, _value(v)) for k, v in vars(m).items() if k not in _MODULE_FIELDS))
    return (name, _Same(type(m)), m.training, hooks, attrs)


def _tensor_part(model: nn.Module) -> Hashable:
    first: dict[int, str] = {}
    rows = []
    for kind, named in (("param", model.named_parameters(remove_duplicate=False)),
                        ("buffer", model.named_buffers(remove_duplicate=False))):
        for name, t in named:
            owner = first.setdefault(id(t), name)
            rows.append((kind, name, tuple(t.shape), t.dtype, t.device.type, t.requires_grad, owner))
    return tuple(rows)


def trace_key(model: nn.Module, named: dict, *, dynamic: bool, training: bool | None,
              autocast: tuple) -> Hashable | None:
    """Everything the trace of `model` on `named` depends on that the process can see; None when
    the call must not be cached (global module hooks are installed). A module's backward hooks
    count too: a full backward hook wraps the module's forward in the trace."""
    if (module_hooks._global_forward_hooks or module_hooks._global_forward_pre_hooks
            or module_hooks._global_backward_hooks or module_hooks._global_backward_pre_hooks):
        return None
    flat, spec = pytree.tree_flatten(named)
    inputs = tuple(("tensor", tuple(x.shape), x.dtype, x.device.type, x.requires_grad)
                   if isinstance(x, torch.Tensor) else _value(x) for x in flat)
    modules = tuple(_module_part(n, m) for n, m in model.named_modules(remove_duplicate=False))
    return (modules, _tensor_part(model), str(spec), inputs, dynamic, training, autocast,
            torch.is_grad_enabled(), torch.is_inference_mode_enabled())


def _attribute(model: nn.Module, path: str) -> object:
    obj: object = model
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def bind(kept: ExportedProgram, model: nn.Module) -> ExportedProgram:
    """`kept` reading `model`'s tensors: its state dict by name; a constant that names one of the
    model's tensor attributes takes the model's (one computed in forward stays as traced)."""
    ep = copy.copy(kept)
    ep._state_dict = {name: _attribute(model, name) for name in kept.state_dict}
    ep._constants = {}
    for name, value in kept.constants.items():
        own = _attribute(model, name)
        ep._constants[name] = own if isinstance(own, torch.Tensor) else value
    missing = [n for n, t in ep._state_dict.items() if not isinstance(t, torch.Tensor)]
    if missing:     # the key should make this impossible: fail loudly rather than trace wrongly
        raise RuntimeError(f"trace cache: the model has no tensor at {missing[:3]}")
    return ep


def lookup(key: Hashable | None, model: nn.Module) -> ExportedProgram | None:
    if key is None:
        return None
    if key not in _CACHE:
        _STATS["misses"] += 1
        return None
    _STATS["hits"] += 1
    _CACHE.move_to_end(key)
    return bind(_CACHE[key], model)


def stats() -> dict[str, int]:
    """Hits and misses since the process started (or `clear()`), and traces kept."""
    return {**_STATS, "kept": len(_CACHE)}


def clear() -> None:
    _CACHE.clear()
    _STATS.update(hits=0, misses=0)


def store(key: Hashable | None, ep: ExportedProgram) -> None:
    """Keep `ep` without the model's tensors (they are bound per use; keeping them would keep every
    traced model alive)."""
    if key is None:
        return
    kept = copy.copy(ep)
    kept._state_dict = dict.fromkeys(ep.state_dict)
    kept._constants = dict(ep.constants)
    _CACHE[key] = kept
    _CACHE.move_to_end(key)
    while len(_CACHE) > _KEEP:
        _CACHE.popitem(last=False)
