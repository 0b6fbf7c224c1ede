"""What each kernel slot reads (kernels/dispatch.py): operands of another shape than the slot's
(a [cols] vector where a full tensor is read, a full tensor where a bias is read), empty tensors and
softmax masks of any dtype, on the CPU executor that runs the CUDA sources with guard pages. A call
the kernel cannot read runs the torch implementation; one it can runs the kernel. The first-use
check runs on the call's own operands."""
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from autoshard.kernels import cpu_executor, launch, ops, self_check

pytestmark = pytest.mark.skipif(cpu_executor.compiler() is None,
                                reason="no host C++ compiler (g++ or $CXX): the CPU executor cannot be built here")


def _launches() -> int:
    return sum(launch.LAUNCHES.values())


def test_a_vector_where_a_full_tensor_is_read_runs_the_torch_path():
    """swiglu's `up` and bias_dropout_add's residual as [cols] vectors: the kernels read rows x cols
    elements there (out of bounds before: KernelExecutionError on the guard page)."""
    x, v = torch.randn(6, 40), torch.randn(40)
    with cpu_executor.enabled():
        before = _launches()
        up = ops.swiglu(x, v)
        res = ops.bias_dropout_add(x, v, v, 0.0)
        assert _launches() == before                     # neither kernel ran
    assert torch.allclose(up, F.silu(x) * v, atol=1e-6)
    assert torch.allclose(res, x + v + v, atol=1e-6)


def test_a_full_tensor_where_a_bias_is_read_runs_the_torch_path():
    """A [rows, cols] bias: the kernel reads bias[col], so every row took row 0 (error ~1 before)."""
    x, b = torch.randn(6, 40), torch.randn(6, 40)
    with cpu_executor.enabled():
        before = _launches()
        gelu = ops.bias_gelu(x, b)
        swiglu = ops.swiglu(x, x.flip(0), b, None)
        drop = ops.bias_dropout_add(x, b, x, 0.0)
        assert _launches() == before
    assert torch.allclose(gelu, F.gelu(x + b, approximate="tanh"), atol=1e-6)
    assert torch.allclose(swiglu, F.silu(x + b) * x.flip(0), atol=1e-6)
    assert torch.allclose(drop, x + b + x, atol=1e-6)


def test_operands_that_fit_still_run_the_kernel():
    x, b = torch.randn(6, 40), torch.randn(40)
    with cpu_executor.enabled():
        before = _launches()
        y = ops.bias_gelu(x, b)
        z = ops.swiglu(x, x.t().contiguous().t())            # full-shaped, any strides
        assert _launches() == before + 2
    assert torch.allclose(y, F.gelu(x + b, approximate="tanh"), atol=1e-6)
    assert torch.allclose(z, F.silu(x) * x, atol=1e-6)


@pytest.mark.parametrize("masked_value", [float("-inf"), torch.finfo(torch.float32).min, 0.5, 1.0])
def test_softmax_masks_nonzero_means_masked_in_any_dtype(masked_value):
    """An additive float mask was converted with .to(uint8): -inf, finfo.min and 0.5 became 0 (kept)."""
    s = torch.randn(2, 3, 5, 7)
    mask = torch.zeros(2, 5, 7)
    mask[:, :, 4:] = masked_value
    want = torch.softmax(s.masked_fill(mask.bool()[:, None], float("-inf")), -1)
    with cpu_executor.enabled():
        before = _launches()
        got = ops.scaled_masked_softmax(s, mask, 1.0, False)
        assert _launches() == before + 1
    assert torch.allclose(got, want, atol=1e-6)


@pytest.mark.parametrize("shape", [(3, 0), (0, 8), (0,), (8,)])
def test_empty_tensors_take_the_torch_path(shape):
    """A norm over zero features raised ZeroDivisionError in the launch; a norm of one row (a 1-D x)
    summed its weight's gradient to a scalar in backward."""
    x = torch.randn(shape, requires_grad=True)
    w = torch.randn(shape[-1], requires_grad=True)
    with cpu_executor.enabled():
        y = ops.layer_norm(x, w, None)
        r = ops.rms_norm(x, w)
        g = ops.bias_gelu(x, w)
        (y.sum() + r.sum() + g.sum()).backward()
    assert y.shape == r.shape == g.shape == x.shape and x.grad.shape == x.shape


def _wrong_past(n: int) -> str:
    """bias_gelu.cu with every element from the n-th on written wrong (a grid-size bug)."""
    text = (Path(launch.__file__).with_name("cuda") / "bias_gelu.cu").read_text()
    old = "u[j] = gelu_value(u[j], tanh_form);"
    assert text.count(old) == 1, "the planted bug no longer applies"
    return text.replace(old, f"u[j] = gelu_value(u[j], tanh_form) * (i < {n} ? 1.f : 2.f);")


def test_the_first_use_check_runs_on_the_calls_own_operands():
    """A kernel wrong only past the first 4096 elements is caught on the call that shows it (the
    check used to run a sample of its own, 3 x 40 elements, and passed it); each layout of the
    operands (strided, broadcast) is a key of its own, checked on its own call."""
    self_check.reset()
    try:
        x, b = torch.randn(257, 1536), torch.randn(1536)
        with cpu_executor.enabled(self_check=True, sm_count=1, sources={"bias_gelu.cu": _wrong_past(4096)}):
            with pytest.warns(RuntimeWarning, match="bias_gelu kernel for float32 on cpu failed its first-use check"):
                got = ops.bias_gelu(x, b)
        assert torch.allclose(got, F.gelu(x + b, approximate="tanh"), atol=1e-6)
        with cpu_executor.enabled(self_check=True), warnings.catch_warnings():
            warnings.simplefilter("error")
            ops.swiglu(x[:, :64], x[:, 64:128])                       # strided rows of one tensor
            ops.swiglu(x[:1, :64].expand(5, 64), torch.randn(5, 64))      # a broadcast gate
        variants = {k[3] for k in self_check.RESULTS if k[0] == "swiglu"}
        assert variants == {("tensor:strided", "tensor:strided", "none", "none"),
                            ("tensor:broadcast", "tensor", "none", "none")}, variants
    finally:
        self_check.reset()


def test_the_road_is_remembered_per_call_signature(monkeypatch):
    """kernels/dispatch.py remembers which road a call signature takes: a second call of the same
    shapes, strides, dtypes and flags skips the checks (counted here) and takes the same road; a call
    that differs in a stride, in an operand's shape, or in the integer a further test reads (rotary's
    half) is checked again and may take the other road."""
    from autoshard.kernels import dispatch
    checks = []
    real = dispatch._kernel_args
    monkeypatch.setattr(dispatch, "_kernel_args", lambda *a: checks.append(1) or real(*a))
    x, b = torch.randn(6, 48), torch.randn(48)
    with cpu_executor.enabled():
        for _ in range(3):
            before = _launches()
            ops.bias_gelu(x, b)
            assert _launches() == before + 1                    # the kernel each time
        assert len(checks) == 1
        before = _launches()
        ops.bias_gelu(x, torch.randn(6, 48))                    # a full tensor where the bias is read
        assert _launches() == before and len(checks) == 2       # checked again: the torch road
        ops.bias_gelu(x.t().contiguous().t(), b)                # another layout: checked again
        assert len(checks) == 3
        q, cos, sin = torch.randn(1, 2, 8, 16), torch.randn(1, 8, 16), torch.randn(1, 8, 16)
        before = _launches()
        torch.ops.autoshard.rotary(q, cos, sin, False, 8)       # the kernel's half: d / 2
        torch.ops.autoshard.rotary(q, cos, sin, False, 4)       # not what the kernel rotates at
        assert _launches() == before + 1
