"""Live bytes of the storages ops make, op by op: a dispatch mode that sees every tensor an aten op
returns and learns of its release from the storage's finalizer.

    with LiveBytes("meta", base=state) as live:    # a rank's step on meta tensors (graph_memory.py)
        ...
    live.peak

It counts storages, not tensors (a view adds nothing), and only on one device type: "meta" for a
step run on shapes alone, "cpu" for a measured one (autoshard.testing.memory.PeakBytes). Memory
that never reaches Python (an op's scratch space inside a kernel, a communication library's
buffers) is not seen.
"""
from __future__ import annotations

import weakref

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["LiveBytes"]


class LiveBytes(TorchDispatchMode):
    """Live bytes of storages made on `device` by ops inside the block, on top of `base`; `peak`
    is the most there were at once."""

    def __init__(self, device: str = "cpu", base: int = 0):
        super().__init__()
        self.device, self.base, self.live, self.peak = device, base, 0, base
        self._alive: set[int] = set()

    def _free(self, key: int, nbytes: int) -> None:
        if key in self._alive:
            self._alive.discard(key)
            self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = None
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.device.type == self.device:
                st = t.untyped_storage()
                key = id(st)
                if key in self._alive or not st.nbytes():
                    continue
                if inputs is None:      # an in-place op or a view returns an input's storage: not new
                    inputs = {id(a.untyped_storage()) for a in pytree.tree_leaves((args, kwargs))
                              if isinstance(a, torch.Tensor) and a.device.type == self.device}
                if key not in inputs:
                    self._alive.add(key)
                    self.live += st.nbytes()
                    self.peak = max(self.peak, self.base + self.live)
                    weakref.finalize(st, self._free, key, st.nbytes())
        return out
