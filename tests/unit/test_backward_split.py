"""Tier (a): a stage's backward split into B (input gradients) and W (parameter gradients),
runtime/backward_split.py: the same gradients as one backward, bit for bit, with each piece of work
done once."""
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from autoshard.runtime.backward_split import backward_input, backward_weight


class _Count(TorchDispatchMode):
    """How often each aten op runs."""

    def __init__(self):
        super().__init__()
        self.calls: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.calls[name] = self.calls.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def _stage():
    """Parameters, and a stage reading them: linears, a norm, a weight used twice (one use feeding
    the other), a bf16 copy of a weight (mixed precision) and an output computed from a parameter alone."""
    torch.manual_seed(0)
    w1, b1 = torch.nn.Parameter(torch.randn(8, 8)), torch.nn.Parameter(torch.randn(8))
    norm = torch.nn.LayerNorm(8)
    shared, pos = torch.nn.Parameter(torch.randn(8, 8)), torch.nn.Parameter(torch.randn(4, 8))
    w16 = torch.nn.Parameter(torch.randn(8, 8))
    params = [w1, b1, norm.weight, norm.bias, shared, pos, w16]

    def run(x):
        h = norm(torch.nn.functional.linear(x, w1, b1) + pos).relu()
        h = ((h @ shared) @ shared).tanh()
        h = (h.bfloat16() @ w16.bfloat16()).float()
        return [h, pos * 2]
    return params, run


def test_split_equals_one_backward_bitwise():
    params, run = _stage()
    x = torch.randn(4, 8, requires_grad=True)
    grads = [torch.randn(4, 8), torch.randn(4, 8)]
    torch.autograd.backward(run(x), grads)
    want = [p.grad.clone() for p in params]
    want_x = x.grad.clone()
    for p in params:
        p.grad = None
    x2 = x.detach().clone().requires_grad_()
    back, work = backward_input(run(x2), grads, [x2], params)
    assert torch.equal(back[0], want_x)
    assert all(p.grad is None for p in params)             # B computed no parameter gradient
    backward_weight(work)
    for p, w in zip(params, want):
        assert torch.equal(p.grad, w)


def test_first_stage_does_the_whole_backward_in_b():
    """No input needs a gradient (ids): nothing waits for B, so B is the whole backward and W is
    empty (starting W from the outputs would rerun the stage's collectives and recomputed regions)."""
    params, run = _stage()
    x = torch.randn(4, 8)
    grads = [torch.randn(4, 8), torch.randn(4, 8)]
    torch.autograd.backward(run(x), grads)
    want = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    back, work = backward_input(run(x), grads, [x], params)
    assert back == [None] and work.groups == [] and work.done == []
    assert all(torch.equal(p.grad, w) for p, w in zip(params, want))


def test_weight_matmuls_run_once_and_only_in_w():
    """A stack of linears: one backward runs 2 matmuls a layer (input and weight gradient); B runs
    the input halves, W the weight halves, none twice."""
    torch.manual_seed(0)
    layers = [torch.nn.Linear(16, 16, bias=False) for _ in range(4)]
    params = [m.weight for m in layers]

    def run(x):
        for m in layers:
            x = m(x).relu()
        return [x]
    x = torch.randn(8, 16, requires_grad=True)
    out = run(x)
    with _Count() as full:
        torch.autograd.backward(out, [torch.ones(8, 16)])
    out = run(x)
    with _Count() as b:
        _, work = backward_input(out, [torch.ones(8, 16)], [x], params)
    with _Count() as w:
        backward_weight(work)
    assert full.calls["mm"] == 8
    assert b.calls["mm"] == 4 and w.calls["mm"] == 4


def test_each_parameter_arrives_once_per_microbatch():
    """The gradient buffers count one arrival per parameter and microbatch (runtime/grad_buffer.py)."""
    params, run = _stage()
    arrivals = {id(p): 0 for p in params}
    for p in params:
        p.register_post_accumulate_grad_hook(lambda q: arrivals.__setitem__(id(q), arrivals[id(q)] + 1))
    x = torch.randn(4, 8, requires_grad=True)
    _, work = backward_input(run(x), [torch.ones(4, 8), torch.ones(4, 8)], [x], params)
    assert set(arrivals.values()) == {0}
    backward_weight(work)
    assert set(arrivals.values()) == {1}


def test_a_recomputed_region_runs_once_with_its_weights_in_b():
    torch.manual_seed(0)
    inner, outer = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
    params = [inner.weight, inner.bias, outer.weight, outer.bias]
    runs = []

    def region(h):
        runs.append(1)
        return inner(h).tanh()

    def run(x):
        return [outer(checkpoint(region, x, use_reentrant=False))]
    x = torch.randn(4, 8, requires_grad=True)
    torch.autograd.backward(run(x), [torch.ones(4, 8)])
    want = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    runs.clear()
    x2 = x.detach().clone().requires_grad_()
    _, work = backward_input(run(x2), [torch.ones(4, 8)], [x2], params, keep_in_b=params[:2])
    backward_weight(work)
    assert len(runs) == 2                  # the forward and one recomputation (in B)
    assert all(torch.equal(p.grad, w) for p, w in zip(params, want))


def test_an_input_that_is_a_frontier_gets_its_gradient_from_b():
    """The first stage's taps (runtime/stage_actions.py): B runs down to an embedding's output, which
    is both an input of the split and the embedding weight's frontier node; W computes the weight's
    gradient from what B returned for it."""
    torch.manual_seed(0)
    emb, lin = torch.nn.Embedding(16, 8), torch.nn.Linear(8, 8)
    params = [emb.weight, lin.weight, lin.bias]
    ids = torch.randint(0, 16, (4, 5))
    g = torch.randn(4, 5, 8)
    torch.autograd.backward([lin(emb(ids)).tanh()], [g])
    want = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    tap = emb(ids)
    _, work = backward_input([lin(tap).tanh()], [g], [tap], params)
    assert all(p.grad is None for p in params)
    backward_weight(work)
    assert all(torch.equal(p.grad, w) for p, w in zip(params, want))


def test_w_runs_no_frontier_node_of_the_weight_table():
    """W computes a linear's, a norm weight's and an embedding's gradient from what their autograd
    nodes saved (WEIGHT_GRADS) and hands only the parameter-side chains to the engine: the frontier
    nodes themselves (each a full matmul's worth of graph below it to walk) are not run again."""
    params, run = _stage()
    x = torch.randn(4, 8, requires_grad=True)
    outs = run(x)
    _, work = backward_input(outs, [torch.ones(4, 8), torch.ones(4, 8)], [x], params)
    ran = []
    hooks = [n.register_prehook(lambda g, n=n: ran.append(n.name())) for g in work.groups for n in g.frontier]
    backward_weight(work)
    for h in hooks:
        h.remove()
    assert ran == [], ran


def test_w_falls_back_to_the_engine_for_a_node_outside_the_table():
    """A weight meeting the activations in an op W has no formula for (here a custom autograd
    function) still gets its gradient, through the engine, bit for bit."""
    class Scale(torch.autograd.Function):
        @staticmethod
        def forward(ctx, h, w):
            ctx.save_for_backward(h, w)
            return h * w

        @staticmethod
        def backward(ctx, g):
            h, w = ctx.saved_tensors
            return g * w, (g * h).sum(0)
    torch.manual_seed(0)
    w, lin = torch.nn.Parameter(torch.randn(8)), torch.nn.Linear(8, 8)
    params = [w, lin.weight, lin.bias]

    def run(x):
        return [lin(Scale.apply(x, w)).tanh()]
    x = torch.randn(4, 8, requires_grad=True)
    torch.autograd.backward(run(x), [torch.ones(4, 8)])
    want = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    x2 = x.detach().clone().requires_grad_()
    _, work = backward_input(run(x2), [torch.ones(4, 8)], [x2], params)
    backward_weight(work)
    assert all(torch.equal(p.grad, g) for p, g in zip(params, want))
