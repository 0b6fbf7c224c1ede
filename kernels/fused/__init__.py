"""One module per fused op, each with everything about it (kernels/ops.py lists them)."""
