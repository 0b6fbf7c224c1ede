"""Where a program's rank shards come from: one state of the model, whenever each rank is cut.

Ranks are cut lazily (a torchrun process cuts only its own), so a model changed between two cuts
(`load_state_dict`, an optimizer step, a batch-norm update) would leave ranks holding different
weights. `WeightSource` remembers the state the first rank was cut from (each tensor's identity and
autograd version counter, which every in-place write bumps) and refuses a later cut from another
state. New weights reach a program through `ShardedProgram.load_state_dict`, which writes every
built rank and makes the given state the source of the ranks not built yet.
"""
from __future__ import annotations

import weakref
from typing import Mapping

import torch
from torch import nn

from .errors import ShardingError

__all__ = ["WeightSource", "state_tokens"]


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
        self._tokens: dict[str, tuple[int, int]] | None = None     # the model's state at the first cut
        self._loaded: Mapping[str, torch.Tensor] | None = None
        self.released = False

    @property
    def model(self) -> nn.Module:
        model = self._model if self._model is not None else self._weak()
        if model is None:
            raise ShardingError("this program no longer holds the model: distributed() let it go once this "
                                "process's rank was cut, and nothing else kept it; keep a reference to the model "
                                "to compile again for new input shapes")
        return model

    def tensors(self, cut: list[int]) -> dict[str, torch.Tensor]:
        """The full parameters and buffers for a new rank; `cut`: the ranks cut before it."""
        if self.released:
            raise ShardingError("distributed() released the model's weights from this program; cut every rank you "
                                "need before calling it, or compile another program")
        model = self.model
        if self._loaded is not None:
            return dict(self._loaded)
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

    def load(self, state: Mapping[str, torch.Tensor], all_cut: bool) -> None:
        """Ranks not cut yet come from `state` (a reference, not a copy; dropped once all are cut)."""
        self._loaded = None if all_cut or self.released else state

    def all_cut(self) -> None:
        self._loaded = None

    def release(self) -> None:
        """Hold the model only weakly (a torchrun process has cut its own rank): its memory goes when
        the user lets it go. A model on the meta device holds no memory and stays: materialization
        initializes from it."""
        self.released = True
        self._loaded = None
        if self._model is not None and not all(p.is_meta for p in self._model.parameters()):
            self._model = None
