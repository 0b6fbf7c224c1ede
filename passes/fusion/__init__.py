"""Fusion: subgraph patterns (a table) replaced by autoshard.kernels' fused ops."""
