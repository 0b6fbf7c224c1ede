"""The activation-memory model: Korthikanti's accounting where our graphs agree with Megatron's,
in-flight microbatches read off our own schedules, and the measurement tools it is checked with."""
import pytest
import torch

from autoshard.planning.costmodel import estimate
from autoshard.planning.memory_model import (
    ActivationShape,
    activation_terms,
    inflight_microbatches,
    layer_activation_bytes,
    param_bytes,
    rank_memory,
)
from autoshard.planning.planner import ModelShape, plan
from autoshard.runtime.schedules import make_schedule
from autoshard.testing.memory import PeakBytes, SavedBytes

S, B, H, A = 2048, 1, 12288, 96          # GPT-3 175B's layer, the paper's example


@pytest.mark.parametrize("t", [1, 2, 8])
def test_sixteen_bit_terms_are_korthikantis(t):
    x = ActivationShape(s=S, b=B, h=H, a=A, t=t)
    sbh = S * B * H
    assert layer_activation_bytes(x, "none") == pytest.approx(sbh * (10 + 24 / t + 5 * A * S / (H * t)))
    assert layer_activation_bytes(x, "selective") == pytest.approx(sbh * (10 + 24 / t))
    assert layer_activation_bytes(x, "full") == pytest.approx(2 * sbh)


def test_sequence_parallel_keeps_the_gathered_norm_outputs_whole():
    """Ours: the column matmul saves the all-gathered norm output (Megatron gathers it again in
    backward): sbh (4 + 30/t) + the s^2 terms, where Korthikanti's is 34 sbh / t."""
    t = 8
    x = ActivationShape(s=S, b=B, h=H, a=A, t=t, sp=True)
    sbh = S * B * H
    assert layer_activation_bytes(x, "selective") == pytest.approx(sbh * (4 + 30 / t))
    assert layer_activation_bytes(x, "full") == pytest.approx(2 * sbh / t)
    terms = activation_terms(x, "none")
    assert terms["first norm output"] == terms["second norm output"] == 2 * sbh


def test_flash_attention_keeps_a_log_sum_exp_only():
    x = ActivationShape(s=S, b=B, h=H, a=A, attention="flash", dropout=False)
    assert layer_activation_bytes(x, "none") - layer_activation_bytes(x, "selective") == 2 * A * S * B


def _max_inflight(steps: list, rank: int) -> int:
    live = most = 0
    for act in steps[rank]:
        live += 1 if act.kind == "F" else -1
        most = max(most, live)
    return most


@pytest.mark.parametrize("pp,v,m", [(2, 1, 4), (4, 1, 8), (4, 1, 2), (2, 2, 4), (4, 2, 8), (2, 3, 4), (4, 2, 4)])
def test_inflight_counts_are_those_of_our_schedules(pp, v, m):
    """The model's microbatches in flight per rank = the most forwards without their backward in
    runtime/schedules.py's own action lists (chunk-microbatches when interleaved)."""
    name = "interleaved" if v > 1 else "1f1b"
    steps = make_schedule(name, pp, v, m)
    for r in range(pp):
        assert inflight_microbatches(name, pp, r, m, v) == _max_inflight(steps, r), (r, steps[r])
    gpipe = make_schedule("gpipe", pp, 1, m)
    assert all(inflight_microbatches("gpipe", pp, r, m) == _max_inflight(gpipe, r) for r in range(pp))


def test_gradients_add_to_a_later_peak_only_when_more_microbatches_follow():
    x = ActivationShape(s=128, b=2, h=256, a=8, e=4, m=4)
    one = rank_memory(x, params=10**6, per_param=param_bytes(4, 4), recompute="none",
                      layers_here=4, inflight=1, chunk_microbatches=1)
    two = rank_memory(x, params=10**6, per_param=param_bytes(4, 4), recompute="none",
                      layers_here=4, inflight=1, chunk_microbatches=2)
    assert one.peak == one.state + one.working + max(one.activations, one.gradients)
    assert two.peak == two.state + two.working + two.activations + two.gradients


def test_planner_searches_recompute_and_says_why_a_plan_fits():
    found = plan(ModelShape(hidden=4096, layers=32, heads=32, vocab=51200, seq=2048), gpus=64, global_batch=512)
    assert {e.recompute for e in found} == {"full", "selective", "none"}
    assert found[0].recompute == "none"          # it fits, and recomputing nothing is fastest
    shape = ModelShape(hidden=12288, layers=96, heads=96, vocab=51200, seq=2048)
    megatron = ("1f1b", "interleaved")
    assert {e.recompute for e in plan(shape, gpus=64, global_batch=64, schedules=megatron)} == {"full"}   # only full fits
    # V-Half holds about half of 1F1B's activations: selective recomputation fits with it, and only with it
    found = plan(shape, gpus=64, global_batch=64)
    assert {e.schedule for e in found if e.recompute == "selective"} == {"v-half"}
    assert found[0].recompute == "selective" and "v-half: the fastest of the schedules that fit" in found[0].explain()
    tight = estimate(hidden=12288, layers=96, heads=96, vocab=51200, seq=2048, tp=8, pp=8, dp=1,
                     global_batch=64, microbatch=1, recompute="none")
    assert not tight.fits and "does NOT fit" in tight.explain()
    assert "memory (pipeline rank 0, recompute=none)" in tight.explain() and "activations" in tight.explain()
    only = plan(shape, gpus=64, global_batch=64, recompute="full")
    assert {e.recompute for e in only} == {"full"}


def test_saved_bytes_count_each_storage_once():
    w = torch.randn(64, 64, requires_grad=True)
    x = torch.randn(8, 64, requires_grad=True)
    with SavedBytes() as saved:
        y = (x @ w).relu()          # mm saves x and w, relu its output
        z = y * y                   # saves y twice: counted once
    assert saved.bytes == x.numel() * 4 + w.numel() * 4 + y.numel() * 4
    z.sum().backward()


def test_peak_bytes_sees_allocations_and_frees():
    with PeakBytes(base=100) as peak:
        a = torch.zeros(1000)                # 4000 bytes
        b = a + 1                            # 4000 more
        a.add_(1)                            # in place: nothing new
        del a, b
        c = torch.zeros(500)                 # 2000, after both were freed
    assert peak.peak == 100 + 8000 and peak.live == 2000
    del c


def test_peak_bytes_sees_storages_resized_in_place():
    """Fully sharded parameters free and refill a storage in place (runtime/sharded_params.py), as
    FSDP2 does: no op makes a tensor, yet the bytes come and go."""
    held = torch.zeros(1000)                 # made before: in `base`
    with PeakBytes(base=4000) as peak:
        held.untyped_storage().resize_(0)                # -4000
        made = torch.zeros(500)                          # +2000
        held.untyped_storage().resize_(4000)             # +4000: the peak
        made.untyped_storage().resize_(0)                # -2000, and nothing more when it is freed
        del made
    assert peak.peak == 4000 + 2000 and peak.live == 0, (peak.peak, peak.live)
    assert torch.UntypedStorage.resize_ is not None and held.untyped_storage().nbytes() == 4000


@pytest.mark.parametrize("dp", [1, 2, 4, 8])
def test_bytes_per_parameter_follow_megatrons_accounting(dp):
    """bf16 weights + fp32 grads + fp32 main + 2 fp32 moments = 18; the distributed optimizer
    divides main and moments over dp: 6 + 12/dp. fp32 weights are their own main copy: 16, 8 + 8/dp."""
    assert param_bytes(2, 4, dp=dp).total == 18
    assert param_bytes(2, 4, dp=dp, distributed_optimizer=True).total == 6 + 12 / dp
    assert param_bytes(4, 4, dp=dp).total == 16
    assert param_bytes(4, 4, dp=dp, distributed_optimizer=True).total == 8 + 8 / dp


def test_the_distributed_optimizer_lowers_the_planned_memory_by_the_state_it_divides():
    from autoshard.planning.costmodel import estimate
    size = dict(hidden=4096, layers=32, heads=32, vocab=51200, seq=2048, tp=2, pp=2, dp=8, global_batch=64,
                microbatch=1, virtual=1)
    plain, zero = (estimate(**size, distributed_optimizer=z) for z in (False, True))
    saved = plain.memory.state - zero.memory.state
    params = plain.memory.gradients / 4               # fp32 gradients: 4 bytes a parameter
    assert saved == pytest.approx(params * 12 * (1 - 1 / 8))
