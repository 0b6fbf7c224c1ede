"""The cost model and planner with precision="fp8" (planning/gemm_timing.py, costmodel.estimate):
the layers' linears at the hardware's FP8 rate on one-byte operands, their casts' traffic added,
attention's core products and the LM head at the bf16 rate; refused on hardware without FP8."""
import pytest

from autoshard.planning.costmodel import estimate
from autoshard.planning.gemm_timing import FP8_CAST_BYTES, LayerShape, bytes_seconds, gemm_seconds, layer_gemm_seconds
from autoshard.planning.hardware import get_hardware
from autoshard.planning.planner import ModelShape, plan

H100 = get_hardware("h100-80gb")
GPT_1B = dict(hidden=2048, layers=24, heads=16, vocab=50304, seq=2048)


def test_a_large_gemm_takes_half_the_time_at_the_fp8_rate():
    bf16, fp8 = gemm_seconds(8192, 8192, 8192, H100), gemm_seconds(8192, 8192, 8192, H100, fp8=True)
    assert fp8 / bf16 == pytest.approx(H100.peak_tflops / H100.fp8_tflops)


def test_the_linears_pay_their_casts_and_the_attention_core_stays_bf16():
    x = LayerShape(b=4, s=2048, h=2048, a=16, t=1)
    core = layer_gemm_seconds(x, H100, attention_core_only=True)
    assert layer_gemm_seconds(x, H100, attention_core_only=True, fp8=True) == core
    fwd, _ = layer_gemm_seconds(x, H100, fp8=True)
    casts = bytes_seconds(FP8_CAST_BYTES * (4 * 2048 * 2048 + 2048 * 3 * 2048), H100)     # qkv's x and w alone
    assert fwd > core[0] + casts


def test_fp8_steps_faster_than_bf16_but_not_twice_as_fast():
    """Attention's core, the element-wise ops, the communication and the optimizer stay as they are:
    a 1.3B GPT at dp=8 on H100s is predicted at 0.84 of bf16's step."""
    kw = dict(**GPT_1B, tp=1, pp=1, dp=8, global_batch=64, microbatch=4, recompute="none", hardware="h100-80gb")
    ratio = estimate(**kw, precision="fp8").seconds_per_iteration / estimate(**kw).seconds_per_iteration
    assert 0.5 < ratio < 0.95, ratio


def test_fp8_is_refused_where_there_are_no_fp8_tensor_cores():
    with pytest.raises(ValueError, match="precision='fp8' on a100-80gb: it has no FP8 tensor cores"):
        estimate(**GPT_1B, tp=1, pp=1, dp=8, global_batch=64, hardware="a100-80gb", precision="fp8")


def test_the_planner_plans_fp8_runs_faster():
    shape = ModelShape(**GPT_1B)
    bf16 = plan(shape, gpus=8, global_batch=64, hardware="h100-80gb", top=1)[0]
    fp8 = plan(shape, gpus=8, global_batch=64, hardware="h100-80gb", top=1, precision="fp8")[0]
    assert fp8.seconds_per_iteration < bf16.seconds_per_iteration


def test_the_graphs_step_time_counts_float8_matmuls_at_the_fp8_rate():
    """planning/graph_time.py reads the program's own ops: its _scaled_mm calls are counted apart from
    the bf16 matmuls and priced at the FP8 rate. The FP8 program's linears move from one count to the
    other (the same FLOPs: the forward and both backward products); the LM head stays a bf16 matmul."""
    import copy

    import torch

    from autoshard import autoshard
    from autoshard.planning.graph_memory import walk
    from autoshard.planning.graph_time import work_seconds
    from autoshard.planning.op_cost import OpWork
    from tests.simulation.test_fp8 import _llama
    work = OpWork()
    work.fp8_flops = 1e15
    assert work_seconds(work, H100) == pytest.approx(1e15 / (H100.fp8_tflops * 1e12 * H100.matmul_efficiency))
    model = _llama()
    ids = torch.randint(0, 256, (2, 32))
    counts = {}
    for precision in (None, "fp8"):
        prog = autoshard(copy.deepcopy(model), example_kwargs={"input_ids": ids, "labels": ids}, precision=precision)
        works = [a.work for a in walk(prog, 0).step.actions]
        counts[precision] = (sum(w.matmul_flops for w in works), sum(w.fp8_flops for w in works))
    (bf16, none), (rest, fp8) = counts[None], counts["fp8"]
    assert none == 0 and fp8 > 0 and rest > 0
    assert rest + fp8 == pytest.approx(bf16, rel=1e-6), (bf16, rest, fp8)
