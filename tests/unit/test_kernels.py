"""Fused ops: their sources build for sm_90, their torch implementations and autograd are exact and
within tolerance of float64 (the CUDA kernels are held to the same: tests/gpu/test_cuda_kernels.py)."""
import math
import re

import pytest
import torch
import torch.nn.functional as F

from autoshard.kernels import build, ops
from autoshard.kernels.fused.bias_dropout_add import _mix32
from tests.harness.kernel_accuracy import TOL, assert_within, errors_against_float64, rel_norm
from autoshard.testing.kernel_cases import CASES

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("file", list(build.KERNELS))
def test_kernel_source_compiles_for_sm90(file):
    cubin = build.compile_cubin(file, "sm_90")
    assert cubin.image[:4] == b"\x7fELF"
    assert set(cubin.lowered) == set(build.name_expressions(file)) and all(cubin.lowered.values())
    # ptxas's report: nothing in local memory (no stack arrays, no spills), and at most 64 registers
    # per thread, so 256-thread blocks keep at least half of an SM's threads resident
    assert set(cubin.resources) == set(cubin.lowered)
    heavy = {k: r for k, r in cubin.resources.items() if r.stack_bytes or r.spill_bytes or r.registers > 64}
    assert not heavy, heavy


def test_a_kernel_that_does_not_build_fails_with_the_log(monkeypatch):
    monkeypatch.setattr(build, "source", lambda file: "__global__ void k() { undeclared_name = 1; }")
    with pytest.raises(build.KernelBuildError, match="undeclared_name"):
        build.compile_cubin("rope.cu")


@pytest.mark.parametrize("approximate", ["tanh", "none"])
def test_bias_gelu_is_gelu_of_the_sum(approximate):
    x = torch.randn(3, 7, 33, dtype=torch.float64, requires_grad=True)
    b = torch.randn(33, dtype=torch.float64, requires_grad=True)
    got = ops.bias_gelu(x, b, approximate)
    want = F.gelu(x + b, approximate=approximate)
    assert rel_norm(got, want) < 1e-14
    g = torch.randn_like(got)
    assert all(rel_norm(a, c) < 1e-12 for a, c in zip(torch.autograd.grad(got, (x, b), g),
                                                  torch.autograd.grad(want, (x, b), g)))


def test_swiglu_reads_two_halves_of_one_projection():
    h = torch.randn(4, 5, 2 * 24, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(48, dtype=torch.float64, requires_grad=True)
    gate, up = h.chunk(2, -1)
    gb, ub = bias.chunk(2)
    got = ops.swiglu(gate, up, gb, ub)
    want = F.silu(gate + gb) * (up + ub)
    assert rel_norm(got, want) < 1e-14
    assert torch.autograd.gradcheck(lambda h, b: ops.swiglu(*h.chunk(2, -1), *b.chunk(2)), (h, bias))


@pytest.mark.parametrize("causal,with_mask", [(True, False), (False, True), (True, True)])
def test_scaled_masked_softmax_matches_masked_fill_softmax(causal, with_mask):
    b, h, sq, sk = 2, 3, 5, 9
    x = torch.randn(b, h, sq, sk, dtype=torch.float64, requires_grad=True)
    mask = torch.rand(b, sq, sk) < 0.3 if with_mask else None
    if with_mask:
        mask[0, 1] = True                                   # a fully masked row comes out zero
    got = ops.scaled_masked_softmax(x, mask, 0.125, causal)
    off = torch.zeros(sq, sk, dtype=torch.bool)
    if causal:
        off = torch.ones(sq, sk, dtype=torch.bool).triu(sk - sq + 1)
    if with_mask:
        off = off | mask.unsqueeze(1)
    want = torch.softmax((x * 0.125).masked_fill(off, -math.inf), -1).nan_to_num(0.0)
    assert rel_norm(got, want) < 1e-14
    if with_mask:
        assert (got[0, :, 1] == 0).all()
    assert torch.autograd.gradcheck(lambda x: ops.scaled_masked_softmax(x, mask, 0.125, causal), (x,))


def test_layer_norm_and_rms_norm_match_torch():
    x = torch.randn(2, 6, 40, dtype=torch.float64, requires_grad=True)
    w = torch.randn(40, dtype=torch.float64, requires_grad=True)
    b = torch.randn(40, dtype=torch.float64, requires_grad=True)
    got, want = ops.layer_norm(x, w, b, 1e-5), F.layer_norm(x, (40,), w, b, 1e-5)
    assert rel_norm(got, want) < 1e-13
    g = torch.randn_like(got)
    assert all(rel_norm(a, c) < 1e-12 for a, c in zip(torch.autograd.grad(got, (x, w, b), g),
                                                  torch.autograd.grad(want, (x, w, b), g)))
    got = ops.rms_norm(x, w, 1e-6)
    want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    assert rel_norm(got, want) < 1e-13
    assert torch.autograd.gradcheck(lambda x, w: ops.rms_norm(x, w, 1e-6), (x, w))


def test_rotary_is_the_rotate_half_embedding_and_its_transpose():
    q = torch.randn(2, 3, 7, 16, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 3, 7, 16, dtype=torch.float64, requires_grad=True)
    angle = torch.arange(7.0, dtype=torch.float64)[:, None] * torch.rand(8, dtype=torch.float64)
    cos, sin = torch.cat([angle, angle], -1).cos()[None], torch.cat([angle, angle], -1).sin()[None]

    def half(x):
        x1, x2 = x.chunk(2, -1)
        return torch.cat([-x2, x1], -1)
    gq, gk = ops.rotary(q, k, cos, sin)
    assert rel_norm(gq, q * cos[:, None] + half(q) * sin[:, None]) < 1e-14
    assert rel_norm(gk, k * cos[:, None] + half(k) * sin[:, None]) < 1e-14
    assert torch.autograd.gradcheck(lambda q, k: ops.rotary(q, k, cos, sin), (q, k))


@pytest.mark.parametrize("half", [3, 5])
def test_rotary_split_off_the_middle_is_still_the_written_out_function(half):
    """A split the kernels do not take (not d / 2) runs the general torch path: forward equals the
    written-out rotation, backward its transpose; a bf16 x with an fp32 table promotes to fp32."""
    x = torch.randn(2, 3, 5, 8, dtype=torch.float64, requires_grad=True)
    cos, sin = torch.randn(1, 5, 8, dtype=torch.float64), torch.randn(1, 5, 8, dtype=torch.float64)
    got = torch.ops.autoshard.rotary(x, cos, sin, False, half)
    want = x * cos[:, None] + torch.cat([-x[..., half:], x[..., :half]], -1) * sin[:, None]
    assert rel_norm(got, want) < 1e-14
    assert torch.autograd.gradcheck(lambda x: torch.ops.autoshard.rotary(x, cos, sin, False, half), (x,))
    low = torch.ops.autoshard.rotary(x.detach().bfloat16(), cos.float(), sin.float(), False, half)
    assert low.dtype == torch.float32


def _lowbias32(h: int) -> int:
    h ^= h >> 16
    h = (h * 0x7FEB352D) & 0xFFFFFFFF
    h ^= h >> 15
    h = (h * 0x846CA68B) & 0xFFFFFFFF
    return h ^ (h >> 16)


def test_dropout_hash_on_int64_tensors_is_the_kernels_32_bit_hash():
    vals = [0, 1, 0xFFFF, 0x10000, 0x7FFFFFFF, 0xDEADBEEF, 0xFFFFFFFF]
    got = _mix32(torch.tensor(vals, dtype=torch.int64)).tolist()
    assert got == [_lowbias32(v) for v in vals]


def test_bias_dropout_add_mask_rate_scale_and_replay():
    x, res = torch.randn(64, 256, requires_grad=True), torch.randn(64, 256, requires_grad=True)
    b = torch.randn(256, requires_grad=True)
    assert torch.equal(ops.bias_dropout_add(x, b, res, 0.0), res + (x + b))
    y = ops.bias_dropout_add(x, b, res, 0.25, seed=1234)
    kept = (y - res).detach() != 0
    assert abs(kept.float().mean().item() - 0.75) < 0.01
    assert torch.allclose((y - res)[kept], ((x + b) / 0.75)[kept], rtol=1e-5, atol=1e-5)   # y - res cancels
    assert torch.equal(y, ops.bias_dropout_add(x, b, res, 0.25, seed=1234))        # the seed is the mask
    assert not torch.equal(y, ops.bias_dropout_add(x, b, res, 0.25, seed=1235))
    gx, gb, gr = torch.autograd.grad(y.sum(), (x, b, res))
    assert torch.equal(gx != 0, kept) and torch.allclose(gx[kept], torch.tensor(1 / 0.75))
    assert torch.allclose(gb, gx.sum(0)) and torch.equal(gr, torch.ones_like(gr))
    assert torch.equal(ops.bias_dropout_add(x, b, res, 0.25, training=False), res + (x + b))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_inputs_compute_in_fp32_and_keep_their_dtype(dtype):
    x, b = torch.randn(8, 64), torch.randn(64)
    got = ops.bias_gelu(x.to(dtype), b.to(dtype))
    assert got.dtype == dtype
    assert rel_norm(got, F.gelu(x.to(dtype).float() + b.to(dtype).float(), approximate="tanh")) < 1e-2


@pytest.mark.parametrize("name", ["bias_gelu", "swiglu", "scaled_masked_softmax", "bias_dropout_add", "norm",
                                  "rotary"])
def test_custom_op_registration_passes_opcheck(name):
    """Schema, fake (meta) implementation and autograd registration, as torch.library checks them."""
    t = lambda *s: torch.randn(*s, requires_grad=True)      # noqa: E731
    args = {"bias_gelu": (t(4, 8), t(8), "tanh"), "swiglu": (t(4, 8), t(4, 8), t(8), None),
            "scaled_masked_softmax": (t(1, 2, 4, 4), torch.rand(1, 4, 4) < 0.2, 0.5, True),
            "bias_dropout_add": (t(4, 8), t(8), t(4, 8), 0.1, 7), "norm": (t(4, 8), t(8), t(8), 1e-5, False),
            "rotary": (t(1, 2, 3, 8), torch.randn(1, 3, 8), torch.randn(1, 3, 8), False, 4)}[name]
    torch.library.opcheck(getattr(torch.ops.autoshard, name).default, args)


def _permuted(*shape, device="cpu", grad=True) -> torch.Tensor:
    """A dense tensor of `shape` whose first two dims are swapped in memory."""
    t = torch.randn(shape[1], shape[0], *shape[2:], device=device).transpose(0, 1)
    return t.requires_grad_() if grad else t


def _permuted_args(name: str, device: str) -> tuple:
    p = lambda *s: _permuted(*s, device=device)                  # noqa: E731
    v = lambda n: torch.randn(n, device=device)                  # noqa: E731
    return {"bias_gelu": (p(2, 4, 3, 8), v(8), "tanh"), "swiglu": (p(2, 4, 3, 8), p(2, 4, 3, 8), None, None),
            "scaled_masked_softmax": (p(2, 4, 3, 3), None, 0.5, True),
            "bias_dropout_add": (p(2, 4, 3, 8), v(8), p(2, 4, 3, 8), 0.25, 11),
            "norm": (p(2, 4, 3, 8), v(8), v(8), 1e-5, False),
            "rotary": (p(2, 4, 3, 8), torch.randn(1, 3, 8, device=device), torch.randn(1, 3, 8, device=device),
                       False, 4)}[name]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU"))])
@pytest.mark.parametrize("name", ["bias_gelu", "swiglu", "scaled_masked_softmax", "bias_dropout_add", "norm",
                                  "rotary"])
def test_fused_ops_return_contiguous_outputs_as_their_fakes_say(name, device):
    """Permuted (dense, non-contiguous) inputs, as a real reduce-scatter returns them: every output,
    forward and backward, is contiguous, on every device, with the strides the fake implementation
    gives (torch.compile plans with those), and equal to the op on contiguous copies. Graphs rely on
    it too: GPT-2 views a LayerNorm's output as [-1, C]."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    op = getattr(torch.ops.autoshard, name).default
    args = _permuted_args(name, device)
    out = op(*args)
    outs = out if isinstance(out, tuple) else (out,)
    assert all(o.is_contiguous() for o in outs)
    with FakeTensorMode() as mode:
        fake = op(*(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args))
    assert [f.stride() for f in (fake if isinstance(fake, tuple) else (fake,))] == [o.stride() for o in outs]
    plain = op(*(a.detach().contiguous() if isinstance(a, torch.Tensor) else a for a in args))
    for o, q in zip(outs, plain if isinstance(plain, tuple) else (plain,)):
        assert torch.equal(o, q)
    grad = _permuted(*outs[0].shape, device=device, grad=False)
    leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    grads = torch.autograd.grad(outs[0], leaves, grad)
    assert all(g.shape == a.shape for g, a in zip(grads, leaves))
    assert grads[0].is_contiguous()              # the first input's gradient: the backward op's output
    torch.library.opcheck(op, args)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(CASES))
def test_references_in_each_dtype_are_within_tolerance_of_float64(name, dtype):
    """The torch implementations in fp32 / fp16 / bf16 storage (fp32 math) against float64: what the
    CUDA check below demands of the kernels is what a correct implementation achieves."""
    case = CASES[name]
    for shape in case.shapes:
        assert_within(errors_against_float64(case, shape, dtype, "cpu"), TOL[dtype], f"{name} {shape}")


@pytest.mark.parametrize("case", ["bias_gelu", "swiglu", "bias_dropout_add"])
def test_element_wise_ops_promote_dtypes_like_the_code_they_replace(case):
    """bf16 activations with an fp32 bias or residual: the fused op returns what x + bias would."""
    torch.manual_seed(0)
    x, b32, r32 = torch.randn(4, 8, dtype=torch.bfloat16), torch.randn(8), torch.randn(4, 8)
    fused, plain = {
        "bias_gelu": (lambda: ops.bias_gelu(x, b32, "none"), lambda: F.gelu(x + b32)),
        "swiglu": (lambda: ops.swiglu(x, r32, b32), lambda: F.silu(x + b32) * r32),
        "bias_dropout_add": (lambda: ops.bias_dropout_add(x, b32, r32, 0.0), lambda: r32 + (x + b32)),
    }[case]
    got, want = fused(), plain()
    assert got.dtype == want.dtype == torch.float32 and rel_norm(got, want) < 1e-6


def test_the_fused_op_table_is_the_one_list_of_ops_and_sources():
    """kernels/ops.py's FUSED: every kernel source in kernels/cuda/ belongs to one op, every custom op
    of an entry has its Kernel (and no Kernel is left without an op), and each entry's launches
    name kernels its own source defines."""
    import inspect
    assert sorted(op.source for op in ops.FUSED) == sorted(build.KERNELS)
    for op in ops.FUSED:
        names = {custom._name.split("::")[-1] for custom in op.ops}
        assert names == set(op.kernels), op.source
        for kernel in op.kernels.values():
            launched = re.findall(r'run_kernel\("(\w+)"', inspect.getsource(kernel.impl))
            assert launched and set(launched) <= set(build.KERNELS[op.source]), (op.source, launched)
