"""Where a program's rank shards come from: one state of the model, whenever each rank is cut.

Ranks are cut lazily (a torchrun process cuts only its own), so a model changed between two cuts
(`load_state_dict`, an optimizer step, a batch-norm update) would leave ranks holding different
weights. `WeightSource` remembers the state the first rank was cut from (each tensor's identity and
autograd version counter, which every in-place write bumps) and refuses a later cut from another
state. New weights reach a program through `ShardedProgram.load_state_dict`, which writes every
built rank and makes the given state the source of the ranks not built yet.
"""
from __future__ import annotations

import copy
import weakref
from typing import Mapping

import torch
from torch import nn

from autoshard.compile.rank import slice_layout
from autoshard.errors import ShardingError
from autoshard.parallel.expert_parallel import ExpertGroup
from autoshard.passes.sharding.placement import ParamUse

__all__ = ["WeightSource", "meta_like", "meta_skeleton", "state_tokens", "rank_slice", "copy_into_rank", "check_state_dict"]


def state_tokens(model: nn.Module) -> dict[str, tuple[int, int]]:
    """Per parameter and buffer: (identity, version counter); equal tokens, equal values."""
    tensors = dict(model.named_parameters())
    tensors.update((n, b) for n, b in model.named_buffers() if b is not None)
    return {name: (id(t), t._version) for name, t in tensors.items()}


class WeightSource:
    """The full tensors ranks are cut from: the model's own (checked to be in one state across
    cuts), or a state dict given to `load` (held until every rank that needs it is cut)."""

    def __init__(self, model: nn.Module):
        self._model: nn.Module | None = model
        self._weak = weakref.ref(model)
        self._skeleton: nn.Module | None = None        # the model's structure, kept once it is let go
        self._device: torch.device | None = None
        self._tokens: dict[str, tuple[int, int]] | None = None     # the model's state at the first cut
        self._loaded: Mapping[str, torch.Tensor] | None = None
        self.released = False

    def __deepcopy__(self, memo: dict) -> "WeightSource":
        """The source of a copied program (`copy.deepcopy(prog)`): its model is a copy too, whose
        tensors are new objects at version 0, so the state of the first cut is taken again from the
        copy. If this model changed since that cut, no state of the copy is the right one: it stays
        refused (an empty record matches no state)."""
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        for key, value in self.__dict__.items():
            setattr(new, key, copy.deepcopy(value, memo))
        if self._tokens is not None and new._model is not None:
            new._tokens = state_tokens(new._model) if state_tokens(self.model) == self._tokens else {}
        return new

    def for_capture(self) -> tuple[nn.Module, torch.device | None]:
        """The model to trace for a new input signature, and the device to retarget its graph to:
        the model while someone holds it, else its meta-device skeleton (graphs name the meta
        device until retargeted to the device the weights were on)."""
        model = self._model if self._model is not None else self._weak()
        if model is not None:
            return model, None
        return self._skeleton, self._device

    @property
    def model(self) -> nn.Module:
        model = self._model if self._model is not None else self._weak()
        if model is None:
            raise ShardingError("this program no longer holds the model: distributed() let it go once this "
                                "process's rank was cut, and nothing else kept it (new input signatures are "
                                "traced from its meta-device skeleton)")
        return model

    def tensors(self, cut: list[int]) -> dict[str, torch.Tensor]:
        """The full parameters and buffers for a new rank; `cut`: the ranks cut before it."""
        if self.released:
            raise ShardingError("distributed() released the model's weights from this program; cut every rank you "
                                "need before calling it, or compile another program")
        model = self.model
        if self._loaded is not None:     # a loaded state, the model's tensors where it has none
            out = dict(model.named_parameters())
            out.update((n, b) for n, b in model.named_buffers() if b is not None)
            out.update(self._loaded)
            return out
        now = state_tokens(model)
        if self._tokens is None or not cut:
            self._tokens = now
        elif now != self._tokens:
            name = next(n for n in sorted(set(now) | set(self._tokens)) if now.get(n) != self._tokens.get(n))
            raise ShardingError(f"the model's {name} changed (load_state_dict, an optimizer step or an in-place "
                                f"update) after rank(s) {cut} were cut from it, so a new rank would hold other "
                                f"weights; load new weights into every rank with prog.load_state_dict(...), or "
                                f"compile a new program")
        out: dict[str, torch.Tensor] = dict(model.named_parameters())
        out.update((n, b) for n, b in model.named_buffers() if b is not None)
        return out

    def load(self, state: Mapping[str, torch.Tensor]) -> None:
        """Ranks not cut yet come from `state` (a reference, not a copy; `all_cut` drops it)."""
        self._loaded = None if self.released else state

    def all_cut(self) -> None:
        self._loaded = None

    def release(self) -> None:
        """Hold the model only weakly (a torchrun process has cut its own rank): its memory goes when
        the user lets it go. A model on the meta device holds no memory and stays: materialization
        initializes from it."""
        self.released = True
        self._loaded = None
        if self._model is not None and not all(p.is_meta for p in self._model.parameters()):
            self._skeleton = meta_skeleton(self._model)
            self._device = next((p.device for p in self._model.parameters()), torch.device("cpu"))
            self._model = None

    def buffer_names(self) -> set[str]:
        """The model's buffer names (empty once the model is gone)."""
        model = self._model if self._model is not None else self._weak()
        return {n for n, _ in model.named_buffers()} if model is not None else set()


def meta_skeleton(model: nn.Module) -> nn.Module:
    """A copy of `model` whose parameters and buffers are on the meta device (no storage): enough
    to trace it again. Tied parameters stay tied."""
    memo: dict[int, object] = {}
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) not in memo:
            memo[id(t)] = meta_like(t)
    return copy.deepcopy(model, memo)


def meta_like(t: torch.Tensor) -> torch.Tensor:
    """`t` on the meta device (no storage), a Parameter again if it was one."""
    meta = t.detach().to("meta")
    return nn.Parameter(meta, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else meta


def rank_slice(full: torch.Tensor, use: ParamUse | None, r: int, experts: ExpertGroup | None = None) -> torch.Tensor:
    """Tensor-parallel rank r's part of a full parameter (all of it where the plan leaves it whole);
    with `experts`, a stacked expert parameter [experts, ...] is first cut to that expert-parallel
    rank's consecutive experts."""
    value = full.detach()
    if experts is not None:
        value = value.narrow(0, experts.rank * experts.per_rank, experts.per_rank)   # [per_rank, ...]
    return slice_layout(value, use.dim, use.layout[r]) if use is not None else value


def copy_into_rank(rank: nn.Module, uses: Mapping[str, ParamUse], state: Mapping[str, torch.Tensor]) -> None:
    """Copy full tensors from `state` into rank module `rank`'s parameters (its slices, its own experts
    where it holds only those) and buffers of the same names and shapes."""
    experts = getattr(rank, "expert_params", set())
    with torch.no_grad():
        params = dict(rank.named_parameters())
        for name, p in params.items():
            if name in state:
                group = rank.expert_group if name in experts else None
                p.copy_(rank_slice(state[name], uses.get(name), rank.rank, group))
        for name, buf in rank.named_buffers():
            if name in state and name not in params and buf.shape == state[name].shape:
                buf.copy_(state[name])


def check_state_dict(state: Mapping[str, torch.Tensor], shapes: Mapping[str, torch.Size], known: set[str],
                     strict: bool) -> None:
    """Refuse a state dict whose parameters have other shapes; with `strict`, also one that misses a
    parameter or holds a name that is none of `shapes` and `known`."""
    missing = sorted(n for n in shapes if n not in state)
    unexpected = sorted(n for n in state if n not in shapes and n not in known)
    if strict and (missing or unexpected):
        raise ShardingError(f"load_state_dict: missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
                            f"unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}")
    for name, shape in shapes.items():
        if name in state and tuple(state[name].shape) != tuple(shape):
            raise ShardingError(f"load_state_dict: {name} has shape {tuple(state[name].shape)}, "
                                f"the model's is {tuple(shape)}")
