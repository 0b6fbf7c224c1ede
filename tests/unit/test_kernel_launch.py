"""The CUDA launch helpers' decisions, checked on the CPU: 16-byte packs, and which calls the
kernels take (the rest go to the exact torch implementation)."""
import contextlib

import torch


def test_16_byte_packs_only_where_the_width_and_every_pointer_allow():
    """The launch helpers run only on CUDA; their pack test is plain pointer arithmetic, checked here."""
    from autoshard.kernels.launch import _aligned, vec
    x = torch.randn(4, 8)                              # fp32: 4 lanes per 16-byte pack
    assert _aligned(x, None) and vec(8, x, x.clone()) == 1
    assert not _aligned(x.view(-1)[1:]) and vec(8, x, x.view(-1)[1:]) == 0     # 4 bytes off
    assert vec(6, x) == 0                             # a width that is not a pack multiple
    assert vec(8, x, strides=(16, 8)) == 1 and vec(8, x, strides=(16, 6)) == 0     # row strides too


def test_cuda_path_takes_only_what_the_kernels_read_else_the_reference():
    """The kernels read every tensor in one dtype and broadcast nothing beyond a vector over the last
    dim: element-wise ops convert their inputs to the promoted dtype, the others take one dtype;
    anything else must go to the exact torch implementation."""
    from autoshard.kernels.dispatch import _kernel_args
    from autoshard.kernels.ops import KERNELS
    x, b = torch.randn(4, 8, dtype=torch.bfloat16), torch.randn(8, dtype=torch.bfloat16)
    _, like, promote, _ = KERNELS["bias_dropout_add"]
    assert _kernel_args((x, b, x.clone(), 0.1, 3), like, promote) is not None
    fp32_bias = _kernel_args((x, b.float(), x, 0.1, 3), like, promote)     # promotes, as x + bias would
    assert [a.dtype for a in fp32_bias[:3]] == [torch.float32] * 3 and fp32_bias[3:] == (0.1, 3)
    assert _kernel_args((x, b, torch.randn(4, 1, dtype=torch.bfloat16), 0.1, 3), like, promote) is None
    assert _kernel_args((x.double(), None, x.double(), 0.0, 0), like, promote) is None      # fp64
    _, like, promote, _ = KERNELS["norm"]
    assert _kernel_args((x, b.float(), b, 1e-5, False), like, promote) is None     # fp32 weight, bf16 data
    assert _kernel_args((x, b, b, 1e-5, False), like, promote) is not None


def test_a_tensor_on_another_device_goes_to_the_reference_not_the_kernel():
    """Kernels read bare device pointers: a bias on another device (here the meta device beside CPU
    data) must take torch's path, whatever the slot's shape allows."""
    from autoshard.kernels.dispatch import _kernel_args
    from autoshard.kernels.ops import KERNELS
    x, b = torch.randn(4, 8), torch.randn(8)
    _, like, promote, _ = KERNELS["bias_gelu"]
    assert _kernel_args((x, b, "tanh"), like, promote) is not None
    assert _kernel_args((x, b.to("meta"), "tanh"), like, promote) is None
    _, like, promote, _ = KERNELS["bias_dropout_add"]
    assert _kernel_args((x, b, x.to("meta"), 0.1, 3), like, promote) is None


def test_a_kernel_argument_is_the_tensors_own_pointer_offset_included():
    """A tensor crosses to CuPy as its data pointer (a slice's start, not its storage's), None as a
    null pointer, scalars unchanged; a tensor on another device than the launch's is refused."""
    import numpy as np
    import pytest

    from autoshard.kernels.launch import kernel_arg
    cpu = torch.device("cpu")
    x = torch.randn(16)
    tail = x[4:]
    assert kernel_arg(tail, cpu) == np.uint64(x.data_ptr() + 4 * x.element_size())
    assert kernel_arg(tail, cpu).dtype == np.uint64
    assert kernel_arg(None, cpu) == np.uint64(0)
    assert kernel_arg(np.int64(7), cpu) == 7
    with pytest.raises(ValueError, match="meta.*launch on cpu"):
        kernel_arg(x.to("meta"), cpu)


def _storages(value) -> set[int]:
    flat = value if isinstance(value, (tuple, list)) else [value]
    return {t.untyped_storage().data_ptr() for t in flat if isinstance(t, torch.Tensor)}


def test_no_fused_op_returns_a_view_of_its_inputs_on_either_cpu_path():
    """The kernel paths are registered without the custom op's per-call aliasing check (host time):
    every autoshard op, forward and backward, with the CPU executor on (where a compiler is) and
    off, returns new tensors, which its schema promises autograd."""
    import pytest
    from torch.utils._python_dispatch import TorchDispatchMode

    from autoshard.kernels import cpu_executor
    from autoshard.testing.kernel_cases import CASES, make_inputs

    seen: list[str] = []

    class NoAliases(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.namespace == "autoshard":
                seen.append(func.name())
                shared = _storages(out) & _storages(args)
                assert not shared, f"{func.name()} returned a tensor sharing storage with an input"
            return out

    executor = [False] + ([True] if cpu_executor.compiler() is not None else [])
    for on in executor:
        for name, case in CASES.items():
            inputs = make_inputs(case, case.shapes[2], torch.float32, "cpu", seed=0)
            with (cpu_executor.enabled() if on else contextlib.nullcontext()), NoAliases():
                out = case.fused(**inputs)
                grads = torch.autograd.grad(out, [inputs[k] for k in case.grads], torch.ones_like(out))
            assert len(grads) == len(case.grads), name
    assert {n.split("::")[-1].split(".")[0] for n in seen} >= {"norm", "norm_backward", "rotary", "swiglu_backward"}
    if not executor[-1]:
        pytest.skip("no C++ compiler: the CPU executor's path was not run")
