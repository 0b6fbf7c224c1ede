"""Mixture-of-experts in the cost model and planner (planning/moe_cost.py): shapes read from HF
configs, what ep changes (weights per GPU, all-to-all time), the all-to-all formula against the
bytes the runtime's all-to-all counts, and the planner's search over ep."""
import pytest
import torch

from autoshard.parallel.comm import GroupComm
from autoshard.parallel.expert_parallel import ExpertGroup, dispatch_combine
from autoshard.planning.cost_formulas import evaluate
from autoshard.planning.costmodel import estimate
from autoshard.planning.moe_cost import MoEShape, moe_shape
from autoshard.planning.planner import ModelShape, plan
from autoshard.testing.models import build_model, build_moe

MIXTRAL_8X7B = dict(hidden=4096, layers=32, heads=32, vocab=32000, seq=4096)


@pytest.mark.parametrize("name, want", [("mixtral", MoEShape(4, 2, 64)), ("qwen3_moe", MoEShape(4, 2, 32)),
                                        ("olmoe", MoEShape(4, 2, 64))])
def test_moe_shape_from_configs(name, want):
    assert moe_shape(build_moe(name)) == want
    assert moe_shape(build_model("llama")) is None


def test_expert_parallelism_divides_the_experts_weights_and_adds_all_to_alls():
    moe = MoEShape(8, 2, 14336)
    runs = {ep: estimate(**MIXTRAL_8X7B, tp=2, pp=1, dp=8, global_batch=64, recompute="none", moe=moe, ep=ep)
            for ep in (1, 2, 4)}
    dense = estimate(**MIXTRAL_8X7B, tp=2, pp=1, dp=8, global_batch=64, recompute="none")
    assert "ep_comm" not in dense.breakdown and runs[1].breakdown["ep_comm"] == 0
    assert runs[1].memory.state > runs[2].memory.state > runs[4].memory.state > dense.memory.state
    # experts: 32 layers x 8 x 3 x 4096 x 14336 / tp=2 weights; ep=2 keeps half of them
    expert_params = 32 * 8 * 3 * 4096 * 14336 / 2
    per_param = 18          # bf16 weights 2, fp32 gradients 4, main weights 4, AdamW moments 8
    saved = (runs[1].memory.state + runs[1].memory.gradients) - (runs[2].memory.state + runs[2].memory.gradients)
    assert saved == pytest.approx(expert_params / 2 * per_param, rel=1e-6)
    assert 0 < runs[2].breakdown["ep_comm"] < runs[4].breakdown["ep_comm"]
    assert runs[2].model_tflops_per_gpu * runs[2].seconds_per_iteration == \
        pytest.approx(runs[4].model_tflops_per_gpu * runs[4].seconds_per_iteration)      # same FLOPs
    with pytest.raises(ValueError, match="ep=3 must divide dp=8"):
        estimate(**MIXTRAL_8X7B, tp=2, pp=1, dp=8, global_batch=64, moe=moe, ep=3)
    with pytest.raises(ValueError, match="a dense model has ep=1"):
        estimate(**MIXTRAL_8X7B, tp=2, pp=1, dp=8, global_batch=64, ep=2)


def test_distributed_optimizer_divides_expert_state_over_dp_over_ep_only():
    """The runtime shards the experts' main weights and moments over the dp/ep ranks holding the same
    experts (runtime/flat_params.py), everything else over dp: before, the model divided both by dp
    and under-counted the experts' state ep times."""
    moe = MoEShape(8, 2, 14336)
    runs = {(ep, zero): estimate(**MIXTRAL_8X7B, tp=2, pp=1, dp=8, global_batch=64, recompute="none", moe=moe, ep=ep,
                                 distributed_optimizer=zero) for ep in (1, 2) for zero in (False, True)}
    expert_params = 32 * 8 * 3 * 4096 * 14336 / 2 / 2               # on the rank at tp=2, ep=2
    main_and_moments = 12                                            # fp32 main weights and AdamW's two moments
    saved = runs[2, False].memory.state - runs[2, True].memory.state
    dense_saved = runs[1, False].memory.state - runs[1, True].memory.state       # everything over dp=8
    params_ep1 = dense_saved / (main_and_moments * (1 - 1 / 8))
    want = (params_ep1 - 2 * expert_params) * main_and_moments * (1 - 1 / 8) + \
        expert_params * main_and_moments * (1 - 1 / 4)                           # experts over dp/ep = 4
    assert saved == pytest.approx(want, rel=1e-6)


class _Loopback(GroupComm):
    """Rank 0 of a group of two whose peer routes exactly as it does: it receives what it sends."""

    def all_to_all(self, t, send, recv):
        assert send == recv
        row = t[0].numel() * t.element_size() if t.dim() > 1 else t.element_size()
        self.sent_bytes += row * (sum(send) - send[0])
        return t.contiguous().clone()


def test_the_all_to_all_formula_is_what_the_runtime_sends_under_even_routing():
    b, s, k, h = 2, 6, 2, 8
    idx = torch.tensor([[0, 2], [1, 3]] * (b * s // 2))         # half the rows to each rank's experts
    x = torch.randn(b * s, h, requires_grad=True)
    w = torch.rand(b * s, k, requires_grad=True)
    group = ExpertGroup(None, 0, 2, 2)
    group.handle.comm = _Loopback()
    out, = dispatch_combine(group.reducer(), [x], [idx], [w], [lambda xs, ids, ws: xs * ws], 2, 2)
    out.sum().backward()
    remote = b * s * k // 2
    tokens = evaluate("moe_all_to_all_bytes", b=b, s=s, K=k, h=h, ep=2) * 2      # formula: 2-byte values; fp32
    assert tokens == remote * h * 4
    # four all-to-alls of tokens (out and back, forward and backward), the weights and their
    # gradients, the expert ids, the counts
    assert group.sent_bytes == 4 * tokens + 2 * remote * 4 + remote * 8 + 8


def test_the_planner_searches_ep_for_moe_models_only():
    # 16 GPUs: ep 1, 2, 4 and 8 are all searched and one ep > 1 wins (64 GPUs took 16 s in the suite)
    shape = ModelShape(**MIXTRAL_8X7B)
    moe_plans = plan(shape, gpus=16, global_batch=256, moe=MoEShape(8, 2, 14336))
    assert moe_plans[0].ep > 1 and {e.ep for e in moe_plans} == {1, 2, 4, 8}
    assert {e.ep for e in plan(shape, gpus=16, global_batch=256)} == {1}
