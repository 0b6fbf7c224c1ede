"""Tier (a): the zero-bubble schedules as data (runtime/schedules.py, runtime/zbv.py, runtime/list_schedule.py):
complete, deadlock-free, their bubbles against Qi et al.'s formulas at F = B = W, and what they hold."""
import pytest

from autoshard.errors import ShardingError
from autoshard.runtime.schedules import (
    Action,
    bubble_fraction,
    check,
    make_schedule,
    overlapped_bubble,
    peak_in_flight,
    schedule_spec,
    splits_backward,
    stage_index,
    stage_owner,
    zb_h1,
)

GRID = [(p, m) for p in range(2, 9) for m in range(p, 33)]


def _costs(name: str) -> dict:
    """F = B = W = 1 per microbatch on a rank, so a chunk of a two-chunk schedule costs 1/2."""
    spec = schedule_spec(name)
    unit = 1 / (spec.chunks or 1)
    return dict(forward_cost=unit, backward_cost=unit, weight_cost=unit, placement=spec.placement)


def _run(name: str, p: int, m: int):
    """The schedule and its unit-cost timeline."""
    v = schedule_spec(name).chunks or 1
    steps = make_schedule(name, p, v, m)
    return steps, check(steps, v, m, **_costs(name))


def _overlapped(name: str, p: int, m: int) -> float:
    v = schedule_spec(name).chunks or 1
    return overlapped_bubble(make_schedule(name, p, v, m), v, m, **_costs(name))


def test_formulas_hold_over_the_grid():
    """At F = B = W, for p <= 8 and p <= m <= 32, a step ending on every rank together: 1F1B
    (p - 1) / m and ZB-H1 (p - 1) / 3m to 0.5 percentage points (exactly, in fact). ZBV below ZB-H1
    everywhere, and from m = 2p - 1 on (written in phases) exactly (p - 1) / 6m: the last rank's
    wait for the first half-size forwards, all the idle time it has."""
    for p, m in GRID:
        assert bubble_fraction(_run("1f1b", p, m)[1]) == pytest.approx((p - 1) / m, abs=5e-3)
        assert bubble_fraction(_run("zb-h1", p, m)[1]) == pytest.approx((p - 1) / (3 * m), abs=5e-3)
        zbv = bubble_fraction(_run("zbv", p, m)[1])
        assert zbv < (p - 1) / (3 * m), (p, m, zbv)
        if m >= 2 * p - 1:
            assert zbv == pytest.approx((p - 1) / (6 * m), abs=1e-9), (p, m, zbv)


def test_overlapped_steps_close_zbvs_bubble():
    """Steps run back to back (as optimizer post-validation allows): ZBV's bubble is 0 from m = 2p - 1
    on, to 0.5 percentage points (exactly, in fact), since every rank is busy from its first action
    to its last; 1F1B and ZB-H1 keep theirs (their idle is inside each rank's span); ZBV cut short
    (m < 2p - 1, list-scheduled) does not close."""
    for p in range(2, 9):
        for m in sorted({2 * p - 1, 2 * p, 3 * p + 1, 32}):
            assert _overlapped("zbv", p, m) == pytest.approx(0.0, abs=1e-9), (p, m)
        assert _overlapped("1f1b", p, 2 * p) == pytest.approx((p - 1) / (2 * p))
        assert _overlapped("zb-h1", p, 2 * p) == pytest.approx((p - 1) / (6 * p))
    assert _overlapped("zbv", 4, 5) > 0.05


def test_zbv_is_written_in_phases_from_2p_minus_1_microbatches():
    """Rank 0 of 2 at m = 3: three chunk-0 forwards, the turn (chunk-1 F B W) twice, one steady round
    (chunk 0's B W and chunk 1's F B W), then the cool-down (chunk 0's B W twice)."""
    steps = make_schedule("zbv", 2, 2, 3)
    assert " ".join(map(str, steps[0])) == ("F0 F1 F2 F0.1 B0.1 W0.1 F1.1 B1.1 W1.1 B0 W0 F2.1 B2.1 W2.1 "
                                             "B1 W1 B2 W2")
    assert [str(a) for a in steps[1][:3]] == ["F0", "F0.1", "F1"]


def test_zero_bubble_with_a_longer_weight_pass_is_zb_h1s_formula():
    """ZB-H1's bubble is (p - 1)(F + B - W) in the paper's terms; with W = 0.5 it is (p - 1) * 1.5."""
    for p, m in [(2, 8), (4, 8), (8, 16)]:
        steps = zb_h1(p, m)
        t = check(steps, 1, m, forward_cost=1.0, backward_cost=1.0, weight_cost=0.5)
        busy = 2.5 * m
        assert t.makespan - busy == pytest.approx((p - 1) * 1.5)


def test_peak_activations_held():
    """Chunk activations held from F to W: 1F1B and ZB-H1 p microbatches on the busiest rank, ZBV 2p
    half-size chunks (1F1B's memory), V-Half p + 1 (about half)."""
    for p, m in [(2, 8), (4, 8), (4, 16), (8, 16)]:
        assert max(peak_in_flight(make_schedule("1f1b", p, 1, m))) == p
        assert max(peak_in_flight(zb_h1(p, m))) == p
        assert max(peak_in_flight(make_schedule("zbv", p, 2, m))) == 2 * p
        assert max(peak_in_flight(make_schedule("v-half", p, 2, m))) == p + 1


def test_zero_bubble_beats_1f1b_and_v_half_sits_between():
    for p, m in [(4, 8), (4, 16), (8, 16), (8, 32)]:
        one, h1, zbv, half = (bubble_fraction(_run(n, p, m)[1]) for n in ("1f1b", "zb-h1", "zbv", "v-half"))
        assert zbv < h1 < one and h1 < half < one, (p, m, one, h1, zbv, half)


def test_the_v_placement_goes_down_and_back_up():
    assert [stage_index(r, 0, 4, "v") for r in range(4)] == [0, 1, 2, 3]
    assert [stage_index(r, 1, 4, "v") for r in range(4)] == [7, 6, 5, 4]
    assert all(stage_owner(stage_index(r, c, 4, "v"), 4, "v") == (r, c) for r in range(4) for c in range(2))
    assert stage_owner(5, 2, "loop") == (1, 2)


def test_split_schedules_run_every_stage_in_microbatch_order():
    """The point-to-point headers and NCCL's issue order need each stage's forwards, and its
    backwards, in microbatch order."""
    for name in ("zb-h1", "zbv", "v-half"):
        steps, _ = _run(name, 4, 12)
        assert splits_backward(steps)
        for acts in steps:
            for kind in "FBW":
                for c in (0, 1):
                    order = [a.microbatch for a in acts if a.kind == kind and a.chunk == c]
                    assert order == sorted(order), (name, kind, c)


def test_checker_knows_weight_actions():
    steps = zb_h1(2, 2)
    with pytest.raises(ShardingError, match="incomplete: 1 actions missing, e.g. W\\(stage 1, microbatch 1\\)"):
        check([steps[0], [a for a in steps[1] if str(a) != "W1"]], 1, 2)
    early = [[Action("F", 0, 0), Action("W", 0, 0), Action("B", 0, 0), Action("F", 0, 1), Action("B", 0, 1),
              Action("W", 0, 1)], steps[1]]
    with pytest.raises(ShardingError, match="deadlocks: rank 0 waits at W0"):
        check(early, 1, 2)


@pytest.mark.parametrize("call,match", [
    (lambda: make_schedule("zbv", 2, 1, 4), "'zbv' runs 2 chunks per rank in a V; got virtual=1"),
    (lambda: make_schedule("zb-h1", 2, 2, 4), "'zb-h1' runs one chunk per rank; virtual=2 needs 'interleaved'"),
    (lambda: stage_index(0, 0, 2, "ring"), "unknown stage placement 'ring'"),
])
def test_invalid_zero_bubble_requests(call, match):
    with pytest.raises(ShardingError, match=match):
        call()


def test_peaks_stop_growing_by_4p_microbatches():
    """The memory model reads a schedule's peak at min(m, 4p) microbatches (memory_model._split_peaks)."""
    for name in ("zb-h1", "zbv", "v-half"):
        v = schedule_spec(name).chunks
        for p in (2, 3, 4, 8):
            assert peak_in_flight(make_schedule(name, p, v, 4 * p)) == peak_in_flight(make_schedule(name, p, v, 9 * p))


def test_the_first_stage_is_tapped_where_the_batch_meets_a_weight():
    """ChunkParams.boundaries: an embedding lookup and a matmul of the input are where B stops on
    the first stage; what follows them reads their outputs, not the batch alone."""
    import torch
    import torch.fx as fx

    from autoshard.runtime.stage_actions import ChunkParams

    class Stage(torch.nn.Module):       # parameters read as attributes: get_attr nodes, as in export's graphs
        def __init__(self):
            super().__init__()
            self.emb, self.pos, self.w = (torch.nn.Parameter(torch.randn(16, 8)), torch.nn.Parameter(torch.randn(4, 8)),
                                          torch.nn.Parameter(torch.randn(8, 8)))

        def forward(self, ids):
            h = torch.nn.functional.embedding(ids, self.emb) + torch.nn.functional.embedding(torch.arange(ids.size(1)), self.pos)
            return (h @ self.w.t()).relu()
    gm = fx.symbolic_trace(Stage())
    found = ChunkParams.boundaries(gm.graph)
    assert [[a.target for a in n.all_input_nodes if a.op == "get_attr"] for n in found] == [["emb"], ["pos"]]
    params = ChunkParams(gm.graph)
    tapped = fx.GraphModule(gm, params.tap_boundaries(gm.graph))
    ids = torch.randint(0, 16, (2, 4))
    assert torch.equal(tapped(ids), gm(ids)) and len(params.taps) == 2
    assert [t.shape for t in params.taps] == [torch.Size([2, 4, 8]), torch.Size([4, 8])]


def test_the_first_stage_runs_whole_backwards_where_its_w_follows_its_b():
    """runtime/stage_actions.whole_backwards: nobody waits for the first stage's input gradients, so
    where its W comes right after its B the split would only cost; ZB-H1's rank 0 does so for every
    microbatch, and so does ZBV's at pp=2; no other stage ever."""
    from types import SimpleNamespace

    from autoshard.runtime.stage_actions import whole_backwards

    def rank(name: str, pp: int, m: int, r: int):
        spec = schedule_spec(name)
        steps = make_schedule(name, pp, spec.chunks or 1, m)
        return SimpleNamespace(actions=steps[r], stage_of=lambda a: a.stage(r, pp, spec.placement))
    assert whole_backwards(rank("zb-h1", 2, 8, 0)) == {(0, i) for i in range(8)}
    assert whole_backwards(rank("zb-h1", 2, 8, 1)) == set()
    assert whole_backwards(rank("zbv", 2, 8, 0)) == {(0, i) for i in range(8)}
    assert whole_backwards(rank("zbv", 4, 8, 0))
    assert whole_backwards(rank("zbv", 2, 8, 1)) == set() == whole_backwards(rank("zbv", 4, 8, 2))
