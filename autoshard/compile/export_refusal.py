"""What a user reads when torch.export cannot trace their model, and what to change.

Most failures are passed through with the tracer's own first line. One kind gets more: a model whose
Python code loops or branches on tensor values (DBRX's experts run `for expert_idx in expert_hit`,
only the experts that received tokens) cannot become one static graph. The message then names the
line and the module it runs in, and the change: an experts implementation without the loop
(transformers' experts interface, `config._experts_implementation = "grouped_mm"`), where the module
supports one, or a loop over every expert.
"""
from __future__ import annotations

import inspect
import os
import traceback

from torch import nn

__all__ = ["export_refusal"]

_LIBRARIES = (os.sep + "torch" + os.sep, os.sep + "autoshard" + os.sep, os.sep + "passes" + os.sep,
              os.sep + "contextlib.py")


def _is_data_dependent(e: BaseException) -> bool:
    return "DataDependent" in type(e).__name__ or "data-dependent" in str(e)


def _model_frame(e: BaseException) -> traceback.FrameSummary | None:
    """The innermost traceback frame in the model's own code (not torch's, not ours)."""
    frames = [f for f in traceback.extract_tb(e.__traceback__) if not any(lib in f.filename for lib in _LIBRARIES)]
    return frames[-1] if frames else None


def _owner(model: nn.Module, frame: traceback.FrameSummary) -> tuple[str, nn.Module] | None:
    """The (path, module) whose forward holds the frame's line."""
    for path, m in model.named_modules():
        fn = getattr(type(m), frame.name, None)
        fn = inspect.unwrap(fn) if callable(fn) else None
        code = getattr(fn, "__code__", None)
        if code is None or os.path.abspath(code.co_filename) != os.path.abspath(frame.filename):
            continue
        lines, start = inspect.getsourcelines(fn)
        if start <= frame.lineno < start + len(lines):
            return path or "<top>", m
    return None


def export_refusal(model: nn.Module, e: BaseException) -> str:
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    base = f"torch.export could not trace {type(model).__name__}: {type(e).__name__}: {first}"
    frame = _model_frame(e) if _is_data_dependent(e) else None
    if frame is None:
        return base
    owner = _owner(model, frame)
    where = f"{os.path.basename(frame.filename)}:{frame.lineno} `{(frame.line or '').strip()}`"
    fix = "change that code so that what it runs does not depend on tensor values"
    if owner is not None:
        path, m = owner
        where += f" in {path} ({type(m).__name__}.{frame.name})"
        if hasattr(m, "has_gate") and hasattr(m, "is_transposed"):      # transformers' experts interface
            fix = (f"set model.config._experts_implementation = \"grouped_mm\" (or \"batched_mm\"): "
                   f"{type(m).__name__} supports transformers' experts interface")
        elif hasattr(m, "num_experts") or "expert" in type(m).__name__.lower():
            fix = (f"{type(m).__name__} does not support transformers' experts interface "
                   f"(config._experts_implementation), so change its code to run every expert "
                   f"(`for e in range(num_experts)` over masked tokens) rather than only those hit, "
                   f"or use a model class whose experts support that interface")
    return (f"torch.export could not trace {type(model).__name__}: {where} loops or branches on tensor values "
            f"(in a mixture of experts: which experts received tokens), which one static graph cannot hold; {fix}. "
            f"The tracer said: {type(e).__name__}: {first}")
