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
