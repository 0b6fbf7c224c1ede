"""Measuring memory on the CPU: bytes autograd saves for backward, and the peak of live tensor bytes.

    with SavedBytes(exclude=model) as saved:      # storages autograd keeps for backward
        loss = model(ids, ids)[1]
    saved.bytes

    with PeakBytes(base=bytes_already_live) as peak:    # every tensor an op makes, until freed
        train_step(...)
    peak.peak

Both count storages, not tensors: views and the same tensor saved twice count once. `PeakBytes` is
a dispatch mode: it sees every tensor an aten op returns (forward, backward, optimizer, the
receive buffers of point-to-point messages) and learns of its release from the storage's
finalizer; memory that never reaches Python (an op's scratch space inside a kernel, gloo's
buffers) is not seen.
"""
from __future__ import annotations

import torch
from torch import nn

from autoshard.planning.live_bytes import LiveBytes

__all__ = ["SavedBytes", "PeakBytes", "state_bytes"]


def _storages(module: nn.Module | None) -> set[int]:
    if module is None:
        return set()
    return {t.untyped_storage().data_ptr() for t in list(module.parameters()) + list(module.buffers())}


def state_bytes(tensors) -> int:
    """Bytes of distinct storages among `tensors`."""
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            st = t.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


class SavedBytes:
    """Distinct storages autograd saves inside the block, parameters and buffers of `exclude` left out."""

    def __init__(self, exclude: nn.Module | None = None):
        self.exclude = _storages(exclude)
        self.kept: dict[int, tuple[int, tuple, torch.dtype]] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in self.exclude:
            self.kept[st.data_ptr()] = (st.nbytes(), tuple(t.shape), t.dtype)
        return t

    @property
    def bytes(self) -> int:
        return sum(n for n, _, _ in self.kept.values())

    def __enter__(self) -> "SavedBytes":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


class PeakBytes(LiveBytes):
    """Live bytes of CPU storages made by ops inside the block, on top of `base`; `peak` is the most
    (planning/live_bytes.py's LiveBytes on the CPU)."""

    def __init__(self, base: int = 0):
        super().__init__("cpu", base)
