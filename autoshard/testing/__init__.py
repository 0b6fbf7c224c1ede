"""Helpers shared by the tests, the demo and the distributed checks (small models, error metrics, fused ops of a graph)."""
from autoshard.testing.graphs import fused_ops
from autoshard.testing.metrics import grad_errors, max_rel
from autoshard.testing.models import MODEL_NAMES, build_model

__all__ = ["MODEL_NAMES", "build_model", "fused_ops", "grad_errors", "max_rel"]
