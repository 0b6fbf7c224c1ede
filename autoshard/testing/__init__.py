"""Helpers shared by the tests, the demo and the distributed checks (small models, error metrics)."""
from .metrics import grad_errors, max_rel
from .models import MODEL_NAMES, build_model

__all__ = ["MODEL_NAMES", "build_model", "grad_errors", "max_rel"]
