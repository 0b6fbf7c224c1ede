"""kernels/eager_autograd.py: on plain tensors a fused op's autograd goes straight to its run (no
custom-op autograd layers); traced, on meta tensors or under a dispatch mode it goes through the
dispatcher, so graphs and modes still see the custom ops, forward and backward."""
import torch
from functorch.compile import aot_function, make_boxed_func
from torch.utils._python_dispatch import TorchDispatchMode

from autoshard.kernels import ops


def _inputs():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=g, requires_grad=True) for shape in ((4, 64), (64,), (64,))]


def test_eager_calls_take_the_direct_autograd_and_match_torch():
    x, w, b = _inputs()
    y = ops.layer_norm(x, w, b)
    assert type(y.grad_fn).__name__ == "norm_eagerBackward", type(y.grad_fn).__name__
    got = torch.autograd.grad(y.square().sum(), [x, w, b])
    want = torch.autograd.grad(torch.nn.functional.layer_norm(x, (64,), w, b).square().sum(), [x, w, b])
    assert all(torch.allclose(a, c, atol=1e-5, rtol=1e-5) for a, c in zip(got, want))


def test_traced_graphs_hold_the_custom_ops_forward_and_backward():
    graphs = []

    def keep(gm, _inputs):
        graphs.append({str(n.target) for n in gm.graph.nodes if str(n.target).startswith("autoshard.")})
        return make_boxed_func(gm)
    x, w, b = _inputs()
    f = aot_function(lambda x, w, b: ops.layer_norm(x, w, b).sum(), fw_compiler=keep, bw_compiler=keep)
    f(x, w, b).backward()
    assert graphs == [{"autoshard.norm.default"}, {"autoshard.norm_backward.default"}], graphs
    assert x.grad is not None and x.grad.abs().sum() > 0


def test_a_dispatch_mode_and_meta_tensors_see_the_custom_op():
    class Seen(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))
    x, w, b = _inputs()
    with Seen() as mode:
        ops.layer_norm(x, w, b).sum().backward()
    assert "autoshard.norm.default" in mode.ops and "autoshard.norm_backward.default" in mode.ops, mode.ops
    meta = [t.detach().to("meta").requires_grad_() for t in (x, w, b)]
    y = ops.layer_norm(*meta)
    assert y.is_meta and y.shape == (4, 64)
    y.sum().backward()
    assert meta[0].grad.is_meta and meta[1].grad.shape == (64,)
