"""The runtime's parts on their own: Transfer over a fake world's wire (receiving ahead too), MeshGroups'
rank lists, the Reducer switch (distributed and simulated give each rank the same), and the global
gradient norm."""
import functools
import types

import pytest
import torch

from autoshard.parallel.comm import SIMULATED, CommHandle, distributed_reducer
from autoshard.runtime import p2p
from autoshard.runtime.gradients import global_grad_norm
from autoshard.runtime.mesh import MeshGroups, ParallelDims


class _Wire:
    """A world's point-to-point transfers, in process: a send lands in a mailbox under its tag."""

    def __init__(self):
        self.box: dict[int, torch.Tensor] = {}

    def p2p(self, ops):
        for o in ops:
            if o.send:
                self.box[o.tag] = o.tensor.clone()
            else:
                o.tensor.copy_(self.box.pop(o.tag))
        return [types.SimpleNamespace(wait=lambda: None) for _ in ops]


def test_transfer_sends_headers_once_and_receives_shapes_and_dtypes():
    wire = _Wire()
    sender, receiver = p2p.Transfer(n_stages=2, world=wire), p2p.Transfer(n_stages=2, world=wire)
    acts = [torch.randn(2, 3, 4), torch.arange(6).view(2, 3)]
    sender.send(acts, dst=1, stage=0, microbatch=0, direction=p2p.FORWARD)
    assert sender.messages_sent == 4                          # a header and a payload each
    got = receiver.recv_forward(2, src=1, stage=1, microbatch=0)
    assert [(g.shape, g.dtype) for g in got] == [(a.shape, a.dtype) for a in acts]
    assert all(torch.equal(g, a) for g, a in zip(got, acts))
    later = [a + 1 for a in acts]
    sender.send(later, dst=1, stage=0, microbatch=1, direction=p2p.FORWARD)
    assert sender.messages_sent == 6                          # no headers after microbatch 0
    assert all(torch.equal(g, a) for g, a in zip(receiver.recv_forward(2, 1, 1, 1), later))
    grads = [torch.randn(2, 3, 4)]
    receiver.send(grads, dst=0, stage=1, microbatch=0, direction=p2p.BACKWARD)
    assert torch.equal(sender.recv_backward([acts[0]], src=1, stage=0, microbatch=0)[0], grads[0])
    assert wire.box == {}


def test_transfer_refuses_a_microbatch_before_the_first():
    with pytest.raises(RuntimeError, match="stage 1 received microbatch 1 before microbatch 0"):
        p2p.Transfer(n_stages=2, world=_Wire()).recv_forward(1, src=0, stage=1, microbatch=1)


class _LateWire(_Wire):
    """As _Wire, but a receive is filled when waited on, not when posted: a test sees when each
    receive was posted (`posted`, their tags in order) apart from when it was taken."""

    def __init__(self):
        super().__init__()
        self.posted: list[int] = []

    def p2p(self, ops):
        works = []
        for o in ops:
            if o.send:
                self.box[o.tag] = o.tensor.clone()
                works.append(types.SimpleNamespace(wait=lambda: None))
            else:
                self.posted.append(o.tag)
                works.append(types.SimpleNamespace(wait=functools.partial(self._fill, o.tensor, o.tag)))
        return works

    def _fill(self, t: torch.Tensor, tag: int) -> None:
        t.copy_(self.box.pop(tag))


def _pair(ahead: bool) -> tuple[_LateWire, p2p.Transfer, p2p.Transfer]:
    """Stage 0 on rank 0 and stage 1 on rank 1, each told its three receives of a step."""
    wire = _LateWire()
    first, last = p2p.Transfer(n_stages=2, rank=0, world=wire), p2p.Transfer(n_stages=2, rank=1, world=wire)
    first.ahead = last.ahead = ahead
    first.expect([p2p.Receive(p2p.BACKWARD, 0, i, 1) for i in range(3)])
    last.expect([p2p.Receive(p2p.FORWARD, 1, i, 0) for i in range(3)])
    return wire, first, last


def test_the_next_receive_is_posted_before_its_action_asks():
    wire, first, last = _pair(ahead=True)
    acts = [torch.randn(2, 3) + i for i in range(3)]
    first.send([acts[0]], dst=1, stage=0, microbatch=0, direction=p2p.FORWARD)
    assert len(wire.posted) == 1              # the gradient of microbatch 0, once its shape went forward
    assert torch.equal(last.recv_forward(1, src=0, stage=1, microbatch=0)[0], acts[0])
    posted = len(wire.posted)                 # and microbatch 1's activation, its shape now known
    first.send([acts[1]], dst=1, stage=0, microbatch=1, direction=p2p.FORWARD)
    assert torch.equal(last.recv_forward(1, src=0, stage=1, microbatch=1)[0], acts[1])
    assert last.received_ahead == 1 and len(wire.posted) == posted + 1     # microbatch 2's, posted already
    grads = [torch.randn(2, 3)]
    last.send(grads, dst=0, stage=1, microbatch=0, direction=p2p.BACKWARD)
    assert torch.equal(first.recv_backward([acts[0]], src=1, stage=0, microbatch=0)[0], grads[0])
    assert first.received_ahead == 1
    last.send(grads, dst=0, stage=1, microbatch=1, direction=p2p.BACKWARD)
    with pytest.raises(RuntimeError, match="stage 0's gradients of microbatch 1 were received ahead as"):
        first.recv_backward([torch.randn(4, 3)], src=1, stage=0, microbatch=1)


def test_without_ahead_each_receive_is_posted_by_its_own_call():
    wire, first, last = _pair(ahead=False)
    for i in range(3):
        first.send([torch.randn(2, 3)], dst=1, stage=0, microbatch=i, direction=p2p.FORWARD)
        before = len(wire.posted)
        last.recv_forward(1, src=0, stage=1, microbatch=i)
        assert len(wire.posted) == before + (2 if i == 0 else 1)     # microbatch 0: its header too
    assert first.received_ahead == last.received_ahead == 0 and wire.box == {}


def test_mesh_groups_hold_megatrons_rank_order():
    dims = ParallelDims(tp=2, pp=2, dp=2)
    assert dims.coords(5) == (1, 0, 1) and dims.rank_of(1, 0, 1) == 5
    groups = MeshGroups(dims, 5, [(0, 1)], world=types.SimpleNamespace(new_group=lambda ranks: tuple(ranks)))
    assert groups.tp == (4, 5) and groups.dp == (5, 7) and groups.shared == {(0, 1): (1, 5)}
    with pytest.raises(IndexError, match="rank 8 out of range for world size 8"):
        dims.coords(8)


class _TwoRankComm:
    """Rank `me` of two, whose peer holds `other`: each collective computed from both tensors."""

    def __init__(self, mine: torch.Tensor, other: torch.Tensor, me: int):
        self.both = [mine, other] if me == 0 else [other, mine]
        self.me = me

    def all_reduce(self, t):
        return self.both[0] + self.both[1]

    def all_reduce_max(self, t):
        return torch.maximum(*self.both)

    def all_gather(self, t, dim):
        return torch.cat(self.both, dim)

    def reduce_scatter(self, t, dim):
        return (self.both[0] + self.both[1]).chunk(2, dim)[self.me]


@pytest.mark.parametrize("field", ["sum", "max", "all_gather", "reduce_scatter", "split"])
def test_distributed_and_simulated_reducers_agree_rank_by_rank(field):
    xs = [torch.randn(4, 6), torch.randn(4, 6)]
    sim = getattr(SIMULATED, field)
    expected = sim(xs) if field in ("sum", "max") else sim(xs, 1)
    for me in range(2):
        handle = CommHandle(me, 2)
        handle.comm = _TwoRankComm(xs[me], xs[1 - me], me)
        red = getattr(distributed_reducer(handle), field)
        got = red([xs[me]]) if field in ("sum", "max") else red([xs[me]], 1)
        torch.testing.assert_close(got[0], expected[me], rtol=0, atol=0)


def test_a_handle_without_a_group_says_how_to_run():
    with pytest.raises(RuntimeError, match="prog.distributed\\(\\) inside torchrun"):
        distributed_reducer(CommHandle(0, 2))


def test_global_grad_norm_counts_shared_rows_once_and_divides_dp_replicas():
    g = torch.randn(4, 3)
    rank0, rank1 = g[0:3], g[1:4]                      # rows 1 and 2 held by both tp ranks
    w0 = torch.tensor([1.0, 0.5, 0.5]).view(3, 1)
    w1 = torch.tensor([0.5, 0.5, 1.0]).view(3, 1)
    weighted = [(rank0, w0), (rank1, w1)]
    torch.testing.assert_close(global_grad_norm(weighted, ParallelDims(tp=2)), g.double().norm())
    replicas = weighted + weighted                     # two data-parallel replicas, equal after the all-reduce
    torch.testing.assert_close(global_grad_norm(replicas, ParallelDims(tp=2, dp=2)), g.double().norm())
