"""Fused CuPy kernels (installed as `autoshard.kernels`). None yet: they arrive with the fusion issue."""
