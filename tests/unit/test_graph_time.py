"""Step time read off a program's own ops (planning/graph_time.py, op_cost.py); measured against our
gloo runs by benchmarks/planner_sweep.py."""
import dataclasses

import pytest
import torch

from autoshard import autoshard
from autoshard.models import GPT, GPTConfig
from autoshard.planning.graph_memory import walk
from autoshard.planning.graph_time import step_time, work_seconds
from autoshard.planning.hardware import get_hardware
from autoshard.planning.op_cost import OpCost, OpWork
from autoshard.runtime.schedules import check, make_schedule


def test_op_cost_counts_matmul_flops_bytes_and_views():
    x = torch.empty(64, 128, device="meta", requires_grad=True)
    w = torch.empty(128, 256, device="meta", requires_grad=True)
    with OpCost() as cost:
        y = (x @ w).relu()
    work = cost.take()
    assert work.matmul_flops == 2 * 64 * 128 * 256 and work.matmul_bytes == 4 * (64 * 128 + 128 * 256 + 64 * 256)
    assert work.other_bytes == 2 * 4 * 64 * 256          # relu reads and writes; its saved detach is a view
    assert work.ops == 3
    with OpCost() as cost:
        y.transpose(0, 1)
    assert cost.take() == OpWork(ops=1)                                    # a view moves nothing


def test_work_seconds_on_a_profile():
    hw = dataclasses.replace(get_hardware("a100-80gb"), op_overhead_s=1e-5, op_bytes_gb_s=100.0, gemm_traffic=False)
    work = OpWork(matmul_flops=312e12 * 0.7, matmul_bytes=0.0, other_bytes=1e11, ops=1000)
    assert work_seconds(work, hw) == pytest.approx(1.0 + 1.0 + 0.01)


def test_the_schedule_takes_each_stages_own_cost():
    """1F1B at pp = 2, one microbatch: F0, F1, B1, B0 one after another."""
    costs = {("F", 0): 1.0, ("F", 1): 2.0, ("B", 1): 4.0, ("B", 0): 8.0}
    timeline = check(make_schedule("1f1b", 2, 1, 1), 1, 1, cost_of=lambda kind, stage: costs[(kind, stage)])
    assert timeline.makespan == 15.0


def _gpt(**options):
    with torch.device("meta"):
        model = GPT(GPTConfig(n_layer=4, n_head=4, n_embd=128, vocab_size=256, block_size=64)).train()
    ids = torch.zeros(2, 64, dtype=torch.long)
    return autoshard(model, example_inputs=(ids, ids), **options)


def test_one_rank_step_is_its_actions_plus_the_steps_end():
    hw = get_hardware("a100-80gb")
    prog = _gpt(microbatches=2)
    actions = walk(prog).step.actions
    assert [a.kind for a in actions] == ["F", "F", "B", "B"] or [a.kind for a in actions] == ["F", "B", "F", "B"]
    t = step_time(prog, hw)
    assert t.breakdown["pipeline"] == pytest.approx(sum(work_seconds(a.work, hw) for a in actions))
    assert t.seconds == pytest.approx(sum(t.breakdown.values())) and t.breakdown["optimizer"] > 0


def test_tensor_parallel_actions_carry_their_collectives():
    actions = walk(_gpt(tp=2)).step.actions
    forward = next(a for a in actions if a.kind == "F")
    kinds = {kind for kind, _, _, _ in forward.collectives}
    assert "all_reduce" in kinds and all(size == 2 and group == "tp" for _, _, size, group in forward.collectives)


def test_a_message_costs_half_a_two_rank_all_reduces_start_up():
    """The profile's latency is a two-rank all-reduce's (two message steps): an all-to-all of two
    ranks or a send is one message, an all-gather half an all-reduce (RESULTS.md: the ep = 2 runs
    were +71% over while every all-to-all paid a whole all-reduce's start-up)."""
    from autoshard.planning.graph_time import _collective_seconds
    hw = dataclasses.replace(get_hardware("a100-80gb"), latency_us=2000.0, nvlink_gb_s=1e6, network_gb_s=1e6)
    assert _collective_seconds("all_reduce", 8, 2, 1e6, hw) == pytest.approx(2e-3)
    assert _collective_seconds("all_to_all", 8, 2, 1e6, hw) == pytest.approx(1e-3)
    assert _collective_seconds("send", 8, 2, 1e6, hw) == pytest.approx(1e-3)
    assert _collective_seconds("all_gather", 8, 2, 1e6, hw) == pytest.approx(1e-3)
    assert _collective_seconds("reduce_scatter", 8, 2, 1e6, hw) == pytest.approx(1e-3)


def test_a_measured_start_up_per_kind_replaces_the_rule():
    """The cpu profile measures each kind (gloo's reduce-scatter costs about an all-reduce): a kind
    it lists is charged its own start-up, an all-to-all as n - 1 sends."""
    from autoshard.planning.graph_time import _collective_seconds
    hw = dataclasses.replace(get_hardware("a100-80gb"), latency_us=2000.0, nvlink_gb_s=1e6, network_gb_s=1e6,
                             startup_us=(("reduce_scatter", 1900.0), ("send", 600.0)))
    assert _collective_seconds("reduce_scatter", 8, 2, 1e6, hw) == pytest.approx(1.9e-3)
    assert _collective_seconds("all_gather", 8, 2, 1e6, hw) == pytest.approx(1e-3)           # not listed: the rule
    assert _collective_seconds("send", 8, 2, 1e6, hw) == pytest.approx(0.6e-3)
    assert _collective_seconds("all_to_all", 8, 4, 1e6, hw) == pytest.approx(3 * 0.6e-3)


def test_the_cpu_attention_kernel_counts_its_flops_apart():
    """Regression: torch's FLOP table lacks the kernel a CPU run calls for SDPA, so a CPU Llama's
    attention was timed as the few bytes of q, k and v. It is counted now, as attention, forward
    and backward (torch's own formulas), and timed at the profile's attention rate."""
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count
    q, k, v = (torch.empty(2, 6, 96, 32, device="meta") for _ in range(3))
    with OpCost() as cost:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True)
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(out, q, k, v, out, lse, 0.0, True)
    work = cost.take()
    want = sdpa_flop_count(q.shape, k.shape, v.shape) + sdpa_backward_flop_count(q.shape, q.shape, k.shape, v.shape)
    assert work.attention_flops == want and work.matmul_flops == 0 and work.other_bytes == 0
    hw = dataclasses.replace(get_hardware("a100-80gb"), attention_tflops=1.0, gemm_traffic=False)
    assert work_seconds(OpWork(attention_flops=1e12), hw) == pytest.approx(1.0)
    plain = dataclasses.replace(hw, attention_tflops=0.0)            # unmeasured: the GEMM rate
    assert work_seconds(OpWork(attention_flops=312e12 * 0.7), plain) == pytest.approx(1.0)


def test_transformers_expert_loop_counts_its_products_and_dispatches():
    """Regression: a Mixtral's experts run transformers' `grouped_mm_fallback`, a Python loop of one
    `torch.mm` per expert opaque to the dispatcher: it was timed as its operands' bytes. Its FLOPs
    (every expert's rows together) and its loop's dispatches are counted now."""
    pytest.importorskip("transformers.integrations.moe")
    rows, hidden, out, experts = 384, 128, 512, 4
    x = torch.empty(rows, hidden, device="meta")
    w = torch.empty(experts, hidden, out, device="meta")
    offs = torch.empty(experts, dtype=torch.int32, device="meta")
    with OpCost() as cost:
        y = torch.ops.transformers.grouped_mm_fallback(x, w, offs)
    forward = cost.take()
    assert forward.matmul_flops == 2 * rows * hidden * out and forward.ops == 1 + 4 * experts + 1
    with OpCost() as cost:
        torch.ops.transformers.grouped_mm_fallback_backward(x, w, offs, y)
    assert cost.take().matmul_flops == 4 * rows * hidden * out


def test_torchs_grouped_product_counts_every_groups_rows():
    a = torch.empty(384, 128, dtype=torch.bfloat16, device="meta")
    b = torch.empty(4, 128, 512, dtype=torch.bfloat16, device="meta")
    offs = torch.empty(4, dtype=torch.int32, device="meta")
    with OpCost() as cost:
        torch._grouped_mm(a, b, offs)
    work = cost.take()
    assert work.matmul_flops == 2 * 384 * 128 * 512 and work.ops == 1
