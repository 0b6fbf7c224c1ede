"""The distributed optimizer's flat layout and its fp32 gradient buffer, in one process."""
import pytest
import torch

from autoshard.runtime.grad_buffer import GradBuffer, plan_layout


@pytest.mark.parametrize("shards", [1, 2, 3, 4])
def test_layout_buckets_pad_and_each_element_has_exactly_one_owner(shards):
    numels = [7, 64, 5, 300, 11, 2]
    lay = plan_layout(numels, shards, bucket_numel=80, tied={1})
    for b in lay.buckets:
        assert (b.stop - b.start) % shards == 0
        members = sum(numels[i] for i in b.params)
        assert members <= 80 or len(b.params) == 1          # a larger parameter is a bucket of its own
        assert b.stop - b.start - members < shards            # padding only to the next multiple
    assert lay.buckets[-1].params == (1,) and lay.buckets[-1].tied        # tied: alone, reduced last
    assert lay.buckets[0].params[0] == len(numels) - 1                   # backward's order: last first
    ranges = sorted((lay.offsets[i], lay.offsets[i] + n) for i, n in enumerate(numels))
    assert all(a[1] <= b[0] for a, b in zip(ranges, ranges[1:]))          # no overlap
    for i, n in enumerate(numels):
        owned = [lay.owned_piece(i, r) for r in range(shards)]
        covered = sorted(p for p in owned if p is not None)
        assert covered[0][0] == lay.offsets[i] and covered[-1][1] == lay.offsets[i] + n
        assert sum(hi - lo for lo, hi in covered) == n                    # a partition of the parameter


def test_gradients_accumulate_in_fp32_and_leave_no_bf16_grad():
    w = torch.nn.Parameter(torch.randn(4, 3, dtype=torch.bfloat16))
    b = torch.nn.Parameter(torch.randn(3, dtype=torch.bfloat16))
    lay = plan_layout([w.numel(), b.numel()], 1, bucket_numel=100)
    buf = GradBuffer([w, b], lay, None, 0, dp=1)
    xs = [torch.randn(2, 4, dtype=torch.bfloat16) for _ in range(2)]     # two microbatches
    loss = lambda x, w_, b_: (x @ w_ + b_).float().pow(2).sum()           # noqa: E731
    want_w = torch.zeros(4, 3)
    for x in xs:
        want_w += torch.autograd.grad(loss(x, w, b), w)[0].float()          # each microbatch's bf16 gradient
    buf.begin(2, 0.5, 0.0)
    for x in xs:
        loss(x, w, b).backward()
        assert w.grad is None and b.grad is None          # moved into the fp32 buffer
    buf.reduce()
    assert buf.view(0).dtype == torch.float32
    assert torch.equal(buf.view(0), 0.5 * want_w)     # summed in fp32, not rounded to bf16 in between
    assert [r.bucket for r in buf.records] == [0]


def test_zero_writes_nothing_and_a_slice_no_gradient_reached_is_reduced_as_zero():
    """zero() only marks the slices stale (no pass over the buffer before a step): the next
    gradient is copied over the old one, and a parameter that gets none in a step (its branch not
    taken) is zeroed when its bucket is reduced, not reduced with the earlier step's values."""
    w, u = torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(3))
    lay = plan_layout([w.numel(), u.numel()], 1, bucket_numel=100)
    buf = GradBuffer([w, u], lay, None, 0, dp=1)
    x = torch.randn(2, 4)
    buf.zero()
    buf.begin(1, 1.0, 0.0)
    (x @ w + u).pow(2).sum().backward()                  # step 1: both get gradients
    buf.reduce()
    step1 = buf.data.clone()
    assert step1[lay.offsets[1]:].abs().sum() > 0
    buf.zero()
    assert torch.equal(buf.data, step1)                  # nothing written by zero()
    buf.begin(1, 1.0, 0.0)
    (x @ w).pow(2).sum().backward()                      # step 2: u takes no part
    buf.reduce()
    assert torch.equal(buf.view(0), torch.autograd.grad((x @ w).pow(2).sum(), w)[0])     # copied, not added
    assert buf.view(1).abs().sum() == 0
