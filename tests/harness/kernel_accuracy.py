"""Fused ops against float64: fresh inputs, outputs poisoned with NaN before every launch, the
output and every input gradient compared norm-wise (tests/unit/test_kernels.py for the torch
implementations, tests/unit/test_cpu_executor.py for the CUDA kernels on the CPU executor,
tests/gpu/test_cuda_kernels.py for them on a GPU: the last two through `check_kernel_case` and
`check_deterministic`)."""
from __future__ import annotations

import zlib

import torch

from autoshard.testing.kernel_cases import CASES, make_inputs

__all__ = ["TOL", "rel_norm", "errors_against_float64", "assert_within", "check_kernel_case", "check_deterministic"]


def rel_norm(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


# norm-relative error against float64 that a correct fp32-math kernel stays under, per storage
# dtype; the references measured themselves (CPU, 2026-11-21) at <= 2.4e-7, 3.1e-4, 2.6e-3
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def _to_reference(inputs: dict, case) -> dict:
    """The same inputs in float64 on the CPU, where the ops run their exact torch implementation."""
    def conv(k, v):
        if not isinstance(v, torch.Tensor):
            return v
        v = v.detach().cpu()
        return v.double().requires_grad_(k in case.grads) if v.is_floating_point() else v
    return {k: conv(k, v) for k, v in inputs.items()}


def errors_against_float64(case, shape, dtype, device) -> dict[str, float]:
    """Fresh inputs (a seed per case, shape and dtype), outputs poisoned with NaN before every
    launch; the fused op's output and every input gradient against float64."""
    from autoshard.kernels.launch import poisoned_outputs
    seed = zlib.crc32(f"{case.name}{shape}{dtype}".encode())
    inputs = make_inputs(case, shape, dtype, device, seed)
    with poisoned_outputs():
        out = case.fused(**inputs)
        grad = torch.randn(out.shape, generator=torch.Generator(device).manual_seed(seed + 1),
                           device=device).to(dtype)
        grads = torch.autograd.grad(out, [inputs[k] for k in case.grads], grad)
    ref = _to_reference(inputs, case)
    want = case.fused(**ref)
    want_grads = torch.autograd.grad(want, [ref[k] for k in case.grads], grad.double().cpu())
    errs = {"out": rel_norm(out.cpu(), want)}
    errs.update({f"d{k}": rel_norm(g.cpu(), w) for k, g, w in zip(case.grads, grads, want_grads)})
    return errs


def assert_within(errs: dict[str, float], tol: float, what: str) -> None:
    bad = {k: e for k, e in errs.items() if not e <= tol}          # NaN (an unwritten element) fails too
    assert not bad, f"{what}: " + ", ".join(f"{k} {e:.2e}" for k, e in bad.items()) + f" > {tol:.0e}"


def check_kernel_case(name: str, dtype: torch.dtype, device: str, what: str) -> None:
    """Every checked shape of case `name` (single elements, tails, odd sizes), outputs poisoned:
    the kernels ran (launch counts, not the torch fallback) and wrote every element correctly."""
    from autoshard.kernels.launch import LAUNCHES
    case = CASES[name]
    for shape in case.shapes:
        before = sum(LAUNCHES.values())
        errs = errors_against_float64(case, shape, dtype, device)
        assert sum(LAUNCHES.values()) - before >= 2, f"{name} {shape}: the kernels did not run (fallback)"
        assert_within(errs, TOL[dtype], f"{name} {shape} {str(dtype).removeprefix('torch.')} on {what}")


def check_deterministic(device: str) -> None:
    """Each case run twice on its largest checked shape, forward and backward, bit-compared: a
    moving result on the same inputs means a race (the norms' weight gradients are per-block
    partials summed in a fixed order)."""
    for case in CASES.values():
        inputs = make_inputs(case, case.shapes[-1], torch.bfloat16, device, 7)
        runs, grad = [], None
        for _ in range(2):
            out = case.fused(**inputs)
            grad = torch.randn_like(out) if grad is None else grad
            runs.append((out, *torch.autograd.grad(out, [inputs[k] for k in case.grads], grad)))
        assert all(torch.equal(a, b) for a, b in zip(*runs)), case.name
