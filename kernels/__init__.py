"""Fused kernels (installed as `autoshard.kernels`): CUDA sources in `cuda/`, compiled by NVRTC
(`build.py`), launched through CuPy (`launch.py`), exposed as torch custom ops with exact torch
fallbacks (`ops.py`; `reference.py`).
Importing this package registers the `autoshard::` ops."""
from autoshard.kernels import ops

__all__ = ["ops"]
