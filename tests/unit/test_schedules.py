"""Tier (a): schedules as data. Completeness, deadlock freedom, Megatron's warm-up, the bubble."""
import pytest

from autoshard.errors import ShardingError
from autoshard.runtime.schedules import (
    Action,
    bubble_fraction,
    check,
    gpipe,
    interleaved_1f1b,
    make_schedule,
    one_f_one_b,
    schedule_spec,
    stage_index,
)

SWEEP = [(pp, v, m) for pp in (1, 2, 3, 4, 8) for v in (1, 2, 3) for m in (pp, 2 * pp, 3 * pp, 4 * pp)]


@pytest.mark.parametrize("pp,v,m", SWEEP)
def test_bubble_is_p_minus_1_over_vm(pp, v, m):
    """Unit costs: bubble / ideal time = (p - 1) / (v m), for 1F1B (v = 1) and interleaved 1F1B."""
    schedule = make_schedule("interleaved" if v > 1 else "1f1b", pp, v, m)
    timeline = check(schedule, v, m)
    assert bubble_fraction(timeline) == pytest.approx((pp - 1) / (v * m), abs=1e-12)
    assert timeline.makespan == 2 * v * m + 2 * (pp - 1)


@pytest.mark.parametrize("pp,m", [(2, 3), (4, 5), (4, 1), (3, 7)])
def test_1f1b_any_microbatch_count(pp, m):
    timeline = check(one_f_one_b(pp, m), 1, m)
    assert bubble_fraction(timeline) == pytest.approx((pp - 1) / m)


@pytest.mark.parametrize("pp,m", [(1, 4), (2, 4), (4, 8)])
def test_gpipe_has_the_same_bubble_and_keeps_all_microbatches(pp, m):
    assert bubble_fraction(check(gpipe(pp, m), 1, m)) == pytest.approx((pp - 1) / m)
    assert gpipe(pp, m)[0][:m] == [Action("F", 0, i) for i in range(m)]


@pytest.mark.parametrize("pp,v,m", [(2, 1, 4), (4, 1, 8), (4, 2, 8), (2, 3, 4)])
def test_warmup_counts_are_megatrons(pp, v, m):
    """Forwards before rank r's first backward: pp - r - 1 for 1F1B, (pp - r - 1) * 2 + (v - 1) * pp
    (capped at v m) for interleaving; plus the one that opens the steady state."""
    schedule = make_schedule("interleaved" if v > 1 else "1f1b", pp, v, m)
    for r, acts in enumerate(schedule):
        first_b = next(i for i, a in enumerate(acts) if a.kind == "B")
        warm = pp - r - 1 if v == 1 else min((pp - r - 1) * 2 + (v - 1) * pp, v * m)
        assert first_b == min(warm + 1, v * m), (r, acts[: first_b + 1])


def test_interleaved_order_walks_chunks_in_groups_of_pp():
    acts = interleaved_1f1b(2, 2, 4)[0]
    forwards = [(a.chunk, a.microbatch) for a in acts if a.kind == "F"]
    assert forwards == [(0, 0), (0, 1), (1, 0), (1, 1), (0, 2), (0, 3), (1, 2), (1, 3)]
    backwards = [(a.chunk, a.microbatch) for a in acts if a.kind == "B"]
    assert backwards == [(1, 0), (1, 1), (0, 0), (0, 1), (1, 2), (1, 3), (0, 2), (0, 3)]


def test_1f1b_holds_at_most_pp_microbatches_in_flight():
    """1F1B's point over GPipe: rank r keeps at most pp - r activations alive, not m."""
    pp, m = 4, 16
    for r, acts in enumerate(one_f_one_b(pp, m)):
        live = peak = 0
        for a in acts:
            live += 1 if a.kind == "F" else -1
            peak = max(peak, live)
        assert peak == pp - r
    assert max(sum(1 for a in acts if a.kind == "F") for acts in gpipe(pp, m)) == m


def test_checker_finds_deadlock():
    schedule = one_f_one_b(2, 2)
    schedule[1] = [Action("B", 0, 0), Action("F", 0, 0), Action("F", 0, 1), Action("B", 0, 1)]
    with pytest.raises(ShardingError, match="deadlocks: .*rank 1 waits at B0"):
        check(schedule, 1, 2)
    # rank 0 waits for microbatch 1's gradient before sending microbatch 1 forward
    schedule = [[Action("F", 0, 0), Action("B", 0, 1), Action("F", 0, 1), Action("B", 0, 0)],
                [Action("F", 0, 0), Action("B", 0, 0), Action("F", 0, 1), Action("B", 0, 1)]]
    with pytest.raises(ShardingError, match="deadlocks"):
        check(schedule, 1, 2)


def test_checker_finds_missing_and_repeated_actions():
    schedule = one_f_one_b(2, 3)
    with pytest.raises(ShardingError, match="incomplete: 1 actions missing, e.g. B\\(stage 1, microbatch 2\\)"):
        check([schedule[0], schedule[1][:-1]], 1, 3)
    with pytest.raises(ShardingError, match="repeated"):
        check([schedule[0] + [Action("F", 0, 0)], schedule[1]], 1, 3)
    with pytest.raises(ShardingError, match="out of range"):
        check([schedule[0] + [Action("F", 0, 3)], schedule[1]], 1, 3)


@pytest.mark.parametrize("call,match", [
    (lambda: interleaved_1f1b(4, 2, 6), "microbatches divisible by pp: 6 microbatches, pp=4"),
    (lambda: make_schedule("1f1b", 2, 2, 4), "virtual=2 needs 'interleaved'"),
    (lambda: make_schedule("zigzag", 2, 1, 4), "unknown schedule 'zigzag'"),
    (lambda: one_f_one_b(0, 4), "pp must be a positive integer, got 0"),
    (lambda: interleaved_1f1b(2, 2, 0), "microbatches must be a positive integer, got 0"),
    (lambda: gpipe(2, 2.5), "microbatches must be a positive integer, got 2.5"),
])
def test_invalid_combinations(call, match):
    with pytest.raises(ShardingError, match=match):
        call()



def _swept(schedule, v: int, placement: str, cost_of) -> list[list[tuple[str, float, float]]]:
    """The timeline by the plainest rule: sweep the ranks again and again, each running what it can,
    until every action has run (how `check` computed it before it woke only the ranks an action frees)."""
    pp = len(schedule)
    done, pos, clock = {}, [0] * pp, [0.0] * pp
    out = [[] for _ in range(pp)]
    while any(pos[r] < len(schedule[r]) for r in range(pp)):
        for r in range(pp):
            while pos[r] < len(schedule[r]):
                a = schedule[r][pos[r]]
                s, i = stage_index(r, a.chunk, pp, placement), a.microbatch
                deps = {"W": [("B", s, i)], "F": [("F", s - 1, i)] if s > 0 else [],
                        "B": [("F", s, i)] + ([("B", s + 1, i)] if s < pp * v - 1 else [])}[a.kind]
                if any(d not in done for d in deps):
                    break
                start = max([clock[r]] + [done[d] for d in deps])
                done[(a.kind, s, i)] = clock[r] = start + cost_of(a.kind, s)
                out[r].append((str(a), start, clock[r]))
                pos[r] += 1
    return out


@pytest.mark.parametrize("name,pp,v,m", [("1f1b", 4, 1, 8), ("interleaved", 4, 2, 8), ("zb-h1", 4, 1, 8),
                                         ("zbv", 3, 2, 6), ("v-half", 4, 2, 8), ("gpipe", 3, 1, 5)])
def test_the_timeline_does_not_depend_on_the_order_the_ranks_are_visited_in(name, pp, v, m):
    """check() wakes a rank when the action it waits for is done; a plain sweep of every rank until
    all have finished gives the same spans to the float, with costs that differ per stage and kind."""
    placement = schedule_spec(name).placement
    costs = {(k, s): 1.0 + 0.37 * s + {"F": 0.0, "B": 0.21, "W": 0.13}[k] for k in "FBW" for s in range(pp * v)}
    schedule = make_schedule(name, pp, v, m)
    got = check(schedule, v, m, placement=placement, cost_of=lambda kind, stage: costs[(kind, stage)])
    want = _swept(schedule, v, placement, lambda kind, stage: costs[(kind, stage)])
    assert [[(str(a), s, e) for a, s, e in row] for row in got.spans] == want


def test_a_transfer_delay_waits_between_ranks_only():
    """check(transfer=): one microbatch through two stages waits for its activation and its gradient
    once each (1F1B: F F B B plus two transfers); the V's turn (stages 1 and 2 on rank 1) does not."""
    from autoshard.runtime.schedules import check, make_schedule
    one = check(make_schedule("1f1b", 2, 1, 1), 1, 1, forward_cost=1.0, backward_cost=1.0, transfer=0.25)
    assert one.makespan == pytest.approx(4.5)
    v = check(make_schedule("zbv", 2, 2, 1), 2, 1, forward_cost=1.0, backward_cost=1.0, weight_cost=0.0,
              placement="v", transfer=0.25)
    assert v.makespan == pytest.approx(8.0 + 4 * 0.25)        # 0->1 and 2->3 each way, not 1->2
