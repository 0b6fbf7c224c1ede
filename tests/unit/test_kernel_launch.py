"""The CUDA launch helpers' decisions, checked on the CPU: 16-byte packs, and which calls the
kernels take (the rest go to the exact torch implementation)."""
import torch


def test_16_byte_packs_only_where_the_width_and_every_pointer_allow():
    """The launch helpers run only on CUDA; their pack test is plain pointer arithmetic, checked here."""
    from autoshard.kernels.launch import _aligned, _vec
    x = torch.randn(4, 8)                              # fp32: 4 lanes per 16-byte pack
    assert _aligned(x, None) and _vec(8, x, x.clone()) == 1
    assert not _aligned(x.view(-1)[1:]) and _vec(8, x, x.view(-1)[1:]) == 0     # 4 bytes off
    assert _vec(6, x) == 0                             # a width that is not a pack multiple
    assert _vec(8, x, strides=(16, 8)) == 1 and _vec(8, x, strides=(16, 6)) == 0     # row strides too


def test_cuda_path_takes_only_what_the_kernels_read_else_the_reference():
    """The kernels read every tensor in one dtype and broadcast nothing beyond a vector over the last
    dim: element-wise ops convert their inputs to the promoted dtype, the others take one dtype;
    anything else must go to the exact torch implementation."""
    from autoshard.kernels.dispatch import _KERNELS, _kernel_args
    x, b = torch.randn(4, 8, dtype=torch.bfloat16), torch.randn(8, dtype=torch.bfloat16)
    _, like, promote, _ = _KERNELS["bias_dropout_add"]
    assert _kernel_args((x, b, x.clone(), 0.1, 3), like, promote) is not None
    fp32_bias = _kernel_args((x, b.float(), x, 0.1, 3), like, promote)     # promotes, as x + bias would
    assert [a.dtype for a in fp32_bias[:3]] == [torch.float32] * 3 and fp32_bias[3:] == (0.1, 3)
    assert _kernel_args((x, b, torch.randn(4, 1, dtype=torch.bfloat16), 0.1, 3), like, promote) is None
    assert _kernel_args((x.double(), None, x.double(), 0.0, 0), like, promote) is None      # fp64
    _, like, promote, _ = _KERNELS["norm"]
    assert _kernel_args((x, b.float(), b, 1e-5, False), like, promote) is None     # fp32 weight, bf16 data
    assert _kernel_args((x, b, b, 1e-5, False), like, promote) is not None
