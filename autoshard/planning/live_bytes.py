"""Live bytes of the storages ops make, op by op: a dispatch mode that sees every tensor an aten op
returns and learns of its release from the storage's finalizer.

    with LiveBytes("meta", base=state) as live:    # a rank's step on meta tensors (graph_memory.py)
        ...
    live.peak

It counts storages, not tensors (a view adds nothing), and only on one device type: "meta" for a
step run on shapes alone, "cpu" for a measured one (autoshard.testing.memory.PeakBytes). Memory
that never reaches Python (an op's scratch space inside a kernel, a communication library's
buffers) is not seen. A storage resized in place (`untyped_storage().resize_`, what fully sharded
data parallelism frees and refills parameters with: runtime/sharded_params.py, and torch's FSDP2)
is no op: the mode wraps UntypedStorage.resize_ while it is active and counts the change.
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
        self._alive: dict[int, int] = {}          # storage id -> its bytes now
        self._resize = None

    def _free(self, key: int) -> None:
        if key in self._alive:
            self.live -= self._alive.pop(key)

    def _add(self, nbytes: int) -> None:
        self.live += nbytes
        self.peak = max(self.peak, self.base + self.live)

    def __enter__(self):
        original = self._resize = torch.UntypedStorage.resize_
        mode = self

        def resize_(storage, nbytes):
            before = storage.nbytes()
            out = original(storage, nbytes)
            if storage.device.type == mode.device:
                key = id(storage)
                if key in mode._alive:
                    mode._alive[key] += nbytes - before
                mode._add(nbytes - before)
            return out
        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._resize
        return super().__exit__(*exc)

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
                    self._alive[key] = st.nbytes()
                    self._add(st.nbytes())
                    weakref.finalize(st, self._free, key)
        return out
