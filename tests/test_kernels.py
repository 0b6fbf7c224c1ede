"""Fused ops: their sources build for sm_90, their torch implementations and autograd are exact, and
their CUDA kernels (when a GPU is present) match a float64 reference."""
import math

import pytest
import torch
import torch.nn.functional as F
from autoshard.kernels import build, ops, reference

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("file", list(build.KERNELS))
def test_kernel_source_compiles_for_sm90(file):
    cubin = build.compile_cubin(file, "sm_90")
    assert cubin.image[:4] == b"\x7fELF"
    assert set(cubin.lowered) == set(build.name_expressions(file)) and all(cubin.lowered.values())


def test_a_kernel_that_does_not_build_fails_with_the_log(monkeypatch):
    monkeypatch.setattr(build, "source", lambda file: "__global__ void k() { undeclared_name = 1; }")
    with pytest.raises(build.KernelBuildError, match="undeclared_name"):
        build.compile_cubin("rope.cu")


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("approximate", ["tanh", "none"])
def test_bias_gelu_is_gelu_of_the_sum(approximate):
    x = torch.randn(3, 7, 33, dtype=torch.float64, requires_grad=True)
    b = torch.randn(33, dtype=torch.float64, requires_grad=True)
    got = ops.bias_gelu(x, b, approximate)
    want = F.gelu(x + b, approximate=approximate)
    assert _rel(got, want) < 1e-14
    g = torch.randn_like(got)
    assert all(_rel(a, c) < 1e-12 for a, c in zip(torch.autograd.grad(got, (x, b), g),
                                                  torch.autograd.grad(want, (x, b), g)))


def test_swiglu_reads_two_halves_of_one_projection():
    h = torch.randn(4, 5, 2 * 24, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(48, dtype=torch.float64, requires_grad=True)
    gate, up = h.chunk(2, -1)
    gb, ub = bias.chunk(2)
    got = ops.swiglu(gate, up, gb, ub)
    want = F.silu(gate + gb) * (up + ub)
    assert _rel(got, want) < 1e-14
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
    assert _rel(got, want) < 1e-14
    if with_mask:
        assert (got[0, :, 1] == 0).all()
    assert torch.autograd.gradcheck(lambda x: ops.scaled_masked_softmax(x, mask, 0.125, causal), (x,))


def test_layer_norm_and_rms_norm_match_torch():
    x = torch.randn(2, 6, 40, dtype=torch.float64, requires_grad=True)
    w = torch.randn(40, dtype=torch.float64, requires_grad=True)
    b = torch.randn(40, dtype=torch.float64, requires_grad=True)
    got, want = ops.layer_norm(x, w, b, 1e-5), F.layer_norm(x, (40,), w, b, 1e-5)
    assert _rel(got, want) < 1e-13
    g = torch.randn_like(got)
    assert all(_rel(a, c) < 1e-12 for a, c in zip(torch.autograd.grad(got, (x, w, b), g),
                                                  torch.autograd.grad(want, (x, w, b), g)))
    got = ops.rms_norm(x, w, 1e-6)
    want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    assert _rel(got, want) < 1e-13
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
    assert _rel(gq, q * cos[:, None] + half(q) * sin[:, None]) < 1e-14
    assert _rel(gk, k * cos[:, None] + half(k) * sin[:, None]) < 1e-14
    assert torch.autograd.gradcheck(lambda q, k: ops.rotary(q, k, cos, sin), (q, k))


def _lowbias32(h: int) -> int:
    h ^= h >> 16
    h = (h * 0x7FEB352D) & 0xFFFFFFFF
    h ^= h >> 15
    h = (h * 0x846CA68B) & 0xFFFFFFFF
    return h ^ (h >> 16)


def test_dropout_hash_on_int64_tensors_is_the_kernels_32_bit_hash():
    vals = [0, 1, 0xFFFF, 0x10000, 0x7FFFFFFF, 0xDEADBEEF, 0xFFFFFFFF]
    got = reference._mix32(torch.tensor(vals, dtype=torch.int64)).tolist()
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
    assert _rel(got, F.gelu(x.to(dtype).float() + b.to(dtype).float(), approximate="tanh")) < 1e-2


@pytest.mark.parametrize("name", ["bias_gelu", "swiglu", "scaled_masked_softmax", "bias_dropout_add", "norm",
                                  "rotary"])
def test_custom_op_registration_passes_opcheck(name):
    """Schema, fake (meta) implementation and autograd registration, as torch.library checks them."""
    t = lambda *s: torch.randn(*s, requires_grad=True)      # noqa: E731
    args = {"bias_gelu": (t(4, 8), t(8), "tanh"), "swiglu": (t(4, 8), t(4, 8), t(8), None),
            "scaled_masked_softmax": (t(1, 2, 4, 4), torch.rand(1, 4, 4) < 0.2, 0.5, True),
            "bias_dropout_add": (t(4, 8), t(8), t(4, 8), 0.1, 7), "norm": (t(4, 8), t(8), t(8), 1e-5, False),
            "rotary": (t(1, 2, 3, 8), torch.randn(1, 3, 8), torch.randn(1, 3, 8), False)}[name]
    torch.library.opcheck(getattr(torch.ops.autoshard, name).default, args)


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (8, 1024), (17, 1000), (2, 4096)])
def test_cuda_kernels_match_the_float64_reference(dtype, shape):
    """Fresh random inputs, outputs poisoned (NaN) before each launch so unwritten elements fail."""
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    x = torch.randn(*shape, device="cuda").to(dtype)
    b = torch.randn(shape[-1], device="cuda").to(dtype)
    for fn in (lambda x, b: ops.bias_gelu(x, b), lambda x, b: ops.layer_norm(x, b, b),
               lambda x, b: ops.rms_norm(x, b), lambda x, b: ops.swiglu(x, x * 0.5, b, None),
               lambda x, b: ops.bias_dropout_add(x, b, x, 0.1, seed=3)):
        with torch.random.fork_rng(devices=[0]):
            got = fn(x, b)
        want = fn(x.double().cpu(), b.double().cpu())
        assert not got.isnan().any() and _rel(got.cpu(), want) < tol


def test_cuda_path_takes_only_what_the_kernels_read_else_the_reference():
    """The kernels read every tensor as the first one's dtype and do not broadcast beyond a vector
    over the last dim; anything else must go to the exact torch implementation."""
    from autoshard.kernels.launch import _KERNELS, _kernel_takes
    x, b = torch.randn(4, 8, dtype=torch.bfloat16), torch.randn(8, dtype=torch.bfloat16)
    like = _KERNELS["bias_dropout_add"][1]
    assert _kernel_takes((x, b, x.clone(), 0.1, 3), like)
    assert not _kernel_takes((x, b.float(), x, 0.1, 3), like)               # an fp32 bias on bf16 data
    assert not _kernel_takes((x, b, torch.randn(4, 1, dtype=torch.bfloat16), 0.1, 3), like)   # broadcast residual
    assert not _kernel_takes((x.double(), None, x.double(), 0.0, 0), like)  # fp64: reference
    assert not _kernel_takes((x, x.float()[0], x[0], 1e-5, False), _KERNELS["norm"][1])   # fp32 LayerNorm weight
