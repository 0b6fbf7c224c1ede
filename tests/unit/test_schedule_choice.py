"""Tier (a): choosing a pipeline schedule with the event simulator, given F, B and W times and a
memory limit (planning/schedule_choice.py), and reading those times from a trace."""
import pytest

from autoshard.errors import ShardingError
from autoshard.planning.schedule_choice import StageTimes, bubble_of, choose_schedule, stage_times
from autoshard.runtime.schedules import Action
from autoshard.runtime.trace import ActionRecord

EVEN = StageTimes(forward=1.0, backward_input=1.0, backward_weight=1.0)


def test_without_a_limit_the_v_wins_and_each_alternative_is_explained():
    choice = choose_schedule(pp=4, microbatches=8, times=EVEN, activation_bytes=8.0)
    assert choice.name == "zbv"
    assert {c.name for c in choice.considered} == {"1f1b", "interleaved", "zb-h1", "zbv", "v-half"}
    by = {c.name: c for c in choice.considered}
    assert by["1f1b"].bubble == pytest.approx(3 / 8) and by["zb-h1"].bubble == pytest.approx(1 / 8)
    # activations held: 1F1B and ZB-H1 p whole microbatches (8 bytes each), ZBV 2p halves, V-Half p + 1 halves
    assert by["1f1b"].activation_bytes == by["zb-h1"].activation_bytes == by["zbv"].activation_bytes == 32.0
    assert by["v-half"].activation_bytes == 20.0
    assert "schedule zbv, the fastest within the memory limit" in choice.explain()


def test_a_tight_limit_picks_v_half_and_nothing_fitting_picks_the_least():
    assert choose_schedule(pp=4, microbatches=8, times=EVEN, activation_bytes=8.0, limit_bytes=24.0).name == "v-half"
    least = choose_schedule(pp=4, microbatches=8, times=EVEN, activation_bytes=8.0, limit_bytes=4.0)
    assert least.name == "v-half" and not least.chosen.fits and "none fits" in least.explain()


def test_no_weight_pass_to_move_leaves_zb_h1_at_1f1bs_bubble():
    """Full recomputation puts the weight gradients in B (runtime/backward_split.py): W = 0."""
    times = StageTimes(1.0, 2.0, 0.0)
    assert bubble_of("zb-h1", 4, 1, 16, times) == pytest.approx(bubble_of("1f1b", 4, 1, 16, times))


def test_bubble_beyond_4p_microbatches_is_the_same_idle_time_spread():
    for name, v in (("1f1b", 1), ("zb-h1", 1)):
        assert bubble_of(name, 4, v, 64, EVEN) == pytest.approx(bubble_of(name, 4, v, 16, EVEN) * 16 / 64)
    assert bubble_of("1f1b", 4, 1, 64, EVEN) == pytest.approx(3 / 64)


def test_interleaved_is_refused_where_it_cannot_run():
    choice = choose_schedule(pp=4, microbatches=6, times=EVEN, activation_bytes=1.0)
    assert "interleaved" in choice.refused and "divisible by pp" in choice.refused["interleaved"]


def test_stage_times_from_a_trace():
    def rec(rank, kind, chunk, i, start, seconds):
        return ActionRecord(rank, rank, 0, Action(kind, chunk, i), start, start + seconds)
    records = [rec(0, "F", 0, 0, 0.0, 0.1), rec(0, "B", 0, 0, 1.0, 0.3)] + \
              [rec(1, k, c, i, 0.0, s) for i in range(3) for c in (0, 1) for k, s in (("F", 0.1), ("B", 0.12), ("W", 0.08))]
    t = stage_times(records)           # rank 1: it runs W (rank 0, a first stage, has none)
    assert (t.forward, t.backward_input, t.backward_weight) == pytest.approx((0.2, 0.24, 0.16))
    with pytest.raises(ShardingError, match="recorded no W action"):
        stage_times(records, rank=0)


def test_a_split_that_costs_more_than_the_bubble_it_removes_is_not_chosen():
    """At pp=2, m=8, F = B = W: 1F1B idles 1/9 of its step, ZB-H1 less. A split backward that costs
    what it was built to (B + W <= 1.05 one backward) still pays; one costing 1.3x does not, and
    the choice says so in its numbers."""
    names = ("1f1b", "zb-h1")
    assert choose_schedule(pp=2, microbatches=8, times=EVEN, activation_bytes=None, names=names).name == "zb-h1"
    assert choose_schedule(pp=2, microbatches=8, times=EVEN, activation_bytes=None, names=names,
                           split_backward=1.05).name == "zb-h1"
    dear = choose_schedule(pp=2, microbatches=8, times=EVEN, activation_bytes=None, names=names, split_backward=1.3)
    assert dear.name == "1f1b" and dear.order() == ["1f1b", "zb-h1"]
    assert "memory not weighed" in dear.explain() and "GiB" not in dear.explain()
