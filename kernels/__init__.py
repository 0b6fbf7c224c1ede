"""Fused kernels (installed as `autoshard.kernels`): CUDA sources in `cuda/`, compiled by NVRTC
(`build.py`), launched through CuPy (`launch.py`), each exposed as a torch custom op with an exact
torch fallback by its module in `fused/`, all of them listed in `ops.py`'s table.
Importing this package registers the `autoshard::` ops."""
from autoshard.kernels import ops

__all__ = ["ops"]
