"""The CUDA kernels run on the CPU executor (kernels/cpu_executor/): every case of the kernel
table under both schedules and both guard placements against float64; planted bugs (a missing
barrier, an out-of-bounds index, a misaligned 16-byte access, a barrier in divergent code) fail;
the host conversions are the PTX ones; launch arguments are checked; the first-use self-check
disables a wrong kernel. Skipped, with the reason, where no host C++ compiler exists."""
import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from autoshard.kernels import cpu_executor, launch, ops, self_check
from autoshard.kernels.cpu_executor import KernelExecutionError
from autoshard.kernels.cpu_executor.config import _from_environment
from tests.harness.kernel_accuracy import TOL, check_deterministic, check_kernel_case, errors_against_float64
from autoshard.testing.kernel_cases import CASES, make_inputs

pytestmark = pytest.mark.skipif(cpu_executor.compiler() is None,
                                reason="no host C++ compiler (g++ or $CXX): the CPU executor of the CUDA kernels "
                                       "cannot be built here; apt install g++")

CUDA_DIR = Path(launch.__file__).with_name("cuda")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (schedule, guard, SM count): both schedules, both guard ends, grids capped at 32 and 96 blocks
SETTINGS = [("lockstep", "end", 1), ("lockstep", "start", 3), ("run-ahead", "end", 3), ("run-ahead", "start", 1)]


def _source(file: str) -> str:
    return (CUDA_DIR / file).read_text()


def _plant(file: str, old: str, new: str) -> dict[str, str]:
    text = _source(file)
    assert text.count(old) == 1, f"{old!r} is not once in {file}: the planted bug no longer applies"
    return {file: text.replace(old, new)}


@pytest.mark.parametrize("schedule,guard,sms", SETTINGS, ids=lambda v: str(v))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(CASES))
def test_every_kernel_case_matches_float64_on_the_cpu_executor(name, dtype, schedule, guard, sms):
    """The GPU test's assertions, on the CPU: every shape (single elements, tails, odd sizes, the
    vector and scalar paths), forward and backward, outputs poisoned, the kernels ran."""
    with cpu_executor.enabled(schedule=schedule, guard=guard, sm_count=sms):
        check_kernel_case(name, dtype, "cpu", f"the CPU executor ({schedule}, guard {guard}, {sms} SMs)")


def test_grid_stride_loops_and_both_paths_ran():
    """With one SM the element-wise grids are capped at 32 blocks of 256 threads, so the largest
    case strides; its width takes 16-byte packs and the (3, 7) case the scalar path."""
    cpu_executor.GRIDS.clear()
    with cpu_executor.enabled(sm_count=1):
        x = torch.randn(257, 1536)
        ops.bias_gelu(x, torch.randn(1536))
    assert cpu_executor.GRIDS == {("bias_gelu_fwd", 32, 256): 1} and 32 * 256 * 4 < x.numel()


def test_kernels_are_deterministic_run_to_run_on_both_schedules():
    for schedule in cpu_executor.SCHEDULES:
        with cpu_executor.enabled(schedule=schedule):
            check_deterministic("cpu")


# ---- planted bugs ---------------------------------------------------------------------------------
def _fails(name: str, shape, sources: dict, schedule: str) -> bool:
    """Whether case `name` at `shape` (fp32) goes wrong or errors with `sources` planted."""
    try:
        with cpu_executor.enabled(schedule=schedule, sources=sources):
            errs = errors_against_float64(CASES[name], shape, torch.float32, "cpu")
    except KernelExecutionError:
        return True
    return not all(e <= TOL[torch.float32] for e in errs.values())


def test_each_missing_barrier_fails_a_case_and_the_run_ahead_schedule_catches_every_one():
    """Delete each of the four __syncthreads in common.cuh's block reductions in turn. Lockstep
    misses the first of each pair (all warps finish reading scratch before any writes it again),
    which is why the run-ahead schedule exists."""
    common = _source("common.cuh")
    lines = common.split("\n")
    barriers = [i for i, line in enumerate(lines) if "__syncthreads();" in line]
    assert len(barriers) == 4
    caught = {}
    for k, at in enumerate(barriers):
        planted = {"common.cuh": "\n".join(line for i, line in enumerate(lines) if i != at)}
        for schedule in cpu_executor.SCHEDULES:
            caught[k, schedule] = (_fails("softmax_causal", (1, 2, 33, 33), planted, schedule)
                                   or _fails("layer_norm", (8, 1024), planted, schedule))
    assert all(caught[k, "run-ahead"] for k in range(4)), caught
    assert not _fails("softmax_causal", (1, 2, 33, 33), {}, "run-ahead")        # the unplanted sources pass


def test_an_out_of_bounds_write_past_the_tail_is_reported():
    """bias_gelu's scalar loop running to i <= n writes one element past the output."""
    planted = _plant("bias_gelu.cu", "for (i64 i = thread_index(); i < n; i += thread_count())\n    y[i]",
                     "for (i64 i = thread_index(); i <= n; i += thread_count())\n    y[i]")
    for guard in ("end", "start"):
        with cpu_executor.enabled(guard=guard, sources=planted):
            with pytest.raises(KernelExecutionError, match=r"out-of-bounds write: a write at byte 0 past its end of "
                                                           r"argument 2 \(a \(3, 7\) float32"):
                ops.bias_gelu(torch.randn(3, 7), torch.randn(7))


def test_an_out_of_bounds_read_faults_on_the_guard_page():
    """softmax reading one key past the row: the last row's read lands on the page after the
    scores (their 4 KiB end flush against it), and the fault names the argument and distance."""
    planted = _plant("softmax.cu", "for (i64 k = threadIdx.x; k < sk; k += blockDim.x) dot +=",
                     "for (i64 k = threadIdx.x; k <= sk; k += blockDim.x) dot +=")
    y = torch.softmax(torch.randn(1, 1, 32, 32), -1)
    with cpu_executor.enabled(guard="end", sources=planted):
        with pytest.raises(KernelExecutionError, match=r"SIGSEGV: out-of-bounds access 0 bytes past its end "
                                                       r"\(a \(1, 1, 32, 32\) float32 tensor of 4096 bytes\), "
                                                       r"argument 0"):
            torch.ops.autoshard.scaled_masked_softmax_backward(torch.randn_like(y), y, 1.0)


def test_a_misaligned_16_byte_access_traps(monkeypatch):
    """The host check that keeps misaligned tensors on the scalar path, removed: the kernel loads
    16-byte packs from a view 4 bytes off, and the alignment check traps."""
    monkeypatch.setattr(launch, "_aligned", lambda *ts: True)
    x = torch.randn(33)[1:].view(4, 8)                     # 4 bytes past a 64-byte aligned start
    with cpu_executor.enabled():
        with pytest.raises(KernelExecutionError, match=r"SIGILL: a trap, the alignment check's .* at block 0 thread 0"):
            ops.bias_gelu(x, torch.randn(8))
    monkeypatch.undo()
    with cpu_executor.enabled():                           # with the check: the scalar path, right
        assert torch.allclose(ops.bias_gelu(x, b := torch.randn(8)), torch.nn.functional.gelu(x + b, approximate="tanh"),
                              rtol=1e-5, atol=1e-6)


def test_barriers_in_divergent_code_are_reported_as_a_deadlock():
    planted = _plant("common.cuh", "  if (lane == 0) scratch[threadIdx.x >> 5] = v;\n  __syncthreads();\n  return warp_sum(",
                     "  if (lane == 0) {\n    scratch[threadIdx.x >> 5] = v;\n    __syncthreads();\n"
                     "  } else {\n    __syncthreads();\n  }\n  return warp_sum(")
    with cpu_executor.enabled(sources=planted):
        with pytest.raises(KernelExecutionError, match=r"deadlock: threads wait at different barriers "
                                                       r"\(common.cuh:\d+ and thread 1 at common.cuh:\d+\)"):
            ops.layer_norm(torch.randn(2, 64), torch.ones(64), torch.zeros(64))


# ---- the executor's own parts ---------------------------------------------------------------------
def test_host_conversions_are_the_ptx_ones():
    """Round to nearest even like torch's conversions for every f16 value and a million random
    fp32 bit patterns (plus the boundaries); NaN comes out as the canonical NaN."""
    lib = cpu_executor.library().lib
    bits = np.random.default_rng(0).integers(0, 2**32, 1_000_000, dtype=np.uint64).astype(np.uint32)
    edges = np.array([0, 0x80000000, 0x7F800000, 0xFF800000, 0x477FEFFF, 0x477FF000, 0x477FF001, 0x33000000,
                      0x33000001, 0x387FC000, 0x38800000, 0x3F800000, 0x7F7FFFFF, 0x7FC00001, 0xFFFFFFFF, 1],
                     dtype=np.uint32)
    bits = np.concatenate([bits, edges])
    x = bits.view(np.float32)
    nan = np.isnan(x)
    for fn, dtype in (("emu_to_half", torch.float16), ("emu_to_bf16", torch.bfloat16)):
        out = np.empty(len(x), dtype=np.uint16)
        getattr(lib, fn)(x.ctypes.data, out.ctypes.data, len(x))
        want = torch.from_numpy(x).to(dtype).view(torch.int16).numpy().view(np.uint16)
        assert np.array_equal(out[~nan], want[~nan]), fn
        assert (out[nan] == 0x7FFF).all(), fn
    halves = np.arange(2**16, dtype=np.uint32).astype(np.uint16)
    back = np.empty(2**16, dtype=np.float32)
    lib.emu_from_half(halves.ctypes.data, back.ctypes.data, len(halves))
    want = torch.from_numpy(halves.view(np.int16)).view(torch.float16).float().numpy()
    finite = ~np.isnan(want)
    assert np.array_equal(back[finite].view(np.uint32), want[finite].view(np.uint32))
    assert (back[~finite].view(np.uint32) == 0x7FFFFFFF).all()


def test_launch_arguments_are_checked_against_the_kernel_parameters():
    lib = cpu_executor.library()
    x = torch.randn(4, 8)
    y = torch.empty_like(x)
    good = (x, None, y, np.int64(32), np.int64(8), np.int32(1), np.int32(0))
    lib.launch("bias_gelu_fwd<float>", 1, 32, good)
    assert torch.allclose(y, torch.nn.functional.gelu(x, approximate="tanh"), rtol=1e-5, atol=1e-6)
    with pytest.raises(KernelExecutionError, match="takes 7 arguments, the launch passed 6"):
        lib.launch("bias_gelu_fwd<float>", 1, 32, good[:6])
    with pytest.raises(KernelExecutionError, match=r"argument 3: the parameter is a 8-byte integer, the launch "
                                                   r"passed int32 \(4 bytes\)"):
        lib.launch("bias_gelu_fwd<float>", 1, 32, good[:3] + (np.int32(32),) + good[4:])
    with pytest.raises(KernelExecutionError, match="argument 4: pass a numpy scalar of 8 bytes"):
        lib.launch("bias_gelu_fwd<float>", 1, 32, good[:4] + (8,) + good[5:])
    with pytest.raises(KernelExecutionError, match="argument 0: a pointer parameter takes a CPU tensor or None"):
        lib.launch("bias_gelu_fwd<float>", 1, 32, (np.int64(0),) + good[1:])
    with pytest.raises(KernelExecutionError, match="argument 2, which the kernel writes, overlaps argument 0"):
        lib.launch("bias_gelu_fwd<float>", 1, 32, (x, None, x[1:]) + good[3:])
    with pytest.raises(KeyError, match="no kernel 'bias_gelu_fwd<double>'"):
        lib.launch("bias_gelu_fwd<double>", 1, 32, good)
    with pytest.raises(ValueError, match="schedule must be one of"):
        cpu_executor.Config(schedule="random")
    with pytest.raises(ValueError, match="sources names unknown files"):
        cpu_executor.Config(sources={"gelu.cu": ""})


def test_a_source_that_does_not_build_fails_with_the_compilers_log():
    with pytest.raises(KernelExecutionError, match=r"does not build:\nrope:\n(.|\n)*rope.cu:\d+"):
        cpu_executor.library({"rope.cu": _source("rope.cu") + "\nthis is not C++;\n"})


def test_without_the_executor_cpu_tensors_run_the_torch_implementation():
    before = sum(launch.LAUNCHES.values())
    ops.bias_gelu(torch.randn(4, 8), torch.randn(8))
    assert cpu_executor.active() is None and sum(launch.LAUNCHES.values()) == before


# ---- the first-use self-check ---------------------------------------------------------------------
WRONG_GELU = ("bias_gelu.cu", "return 0.5f * u * (1.f + t);", "return 0.25f * u * (1.f + t);")


def launch_ops() -> set[str]:
    from autoshard.kernels.ops import KERNELS
    return set(KERNELS)


@pytest.fixture
def fresh_checks():
    self_check.reset()
    yield
    self_check.reset()


def test_self_check_disables_a_wrong_kernel_with_a_warning_and_results_stay_right(fresh_checks):
    """The executor standing in for the GPU, a wrong tanh GeLU planted: the first call warns naming
    the op, dtype and error, and every call gives the torch implementation's result."""
    x, b = torch.randn(6, 16), torch.randn(16)
    want = torch.nn.functional.gelu(x + b, approximate="tanh")
    with cpu_executor.enabled(self_check=True, sources=_plant(*WRONG_GELU)):
        with pytest.warns(RuntimeWarning, match=r"the bias_gelu kernel for float32 on cpu failed its first-use "
                                                r"check \(relative difference .* > 1e-05 from its torch "
                                                r"implementation\); it is disabled"):
            first = ops.bias_gelu(x, b)
        with warnings.catch_warnings():
            warnings.simplefilter("error")                  # warned once, then quietly the torch implementation
            second = ops.bias_gelu(x, b)
        before = sum(launch.LAUNCHES.values())
        erf = ops.bias_gelu(x, b, "none")                   # another variant: its own check, passed, the kernel runs
        ops.bias_gelu(x, b, "none")
        assert sum(launch.LAUNCHES.values()) - before == 2   # the check's launch is the call's own
    assert torch.allclose(first, want, atol=1e-6) and torch.equal(first, second)
    assert torch.allclose(erf, torch.nn.functional.gelu(x + b), atol=1e-6)
    checks = {key[3]: ok for key, (ok, _) in self_check.RESULTS.items() if key[:3] == ("bias_gelu", torch.float32, "cpu")}
    assert checks == {("tensor", "tensor", "tanh"): False, ("tensor", "tensor", "none"): True}


def test_self_check_passes_the_real_kernels_and_they_run(fresh_checks):
    """Every op forward and backward in every dtype: each check passes, quietly, and the kernels run."""
    before = sum(launch.LAUNCHES.values())
    with cpu_executor.enabled(self_check=True), warnings.catch_warnings():
        warnings.simplefilter("error")
        for case in CASES.values():
            for dtype in DTYPES:
                shape = (2, 2, 8, 8) if len(case.shapes[0]) == 4 else (4, 24)
                inputs = make_inputs(case, shape, dtype, "cpu", 0)
                out = case.fused(**inputs)
                torch.autograd.grad(out, [inputs[k] for k in case.grads], torch.ones_like(out))
    assert all(ok for ok, _ in self_check.RESULTS.values()) and {k[:2] for k in self_check.RESULTS} == {
        (op, dtype) for op in launch_ops() for dtype in DTYPES}
    assert sum(launch.LAUNCHES.values()) - before > len(self_check.RESULTS)


def test_self_check_is_off_with_the_environment_variable(fresh_checks, monkeypatch):
    """Proof that the check is what saves the wrong kernel above: without it the result is wrong."""
    monkeypatch.setenv("AUTOSHARD_KERNEL_SELF_CHECK", "0")
    x, b = torch.randn(6, 16), torch.randn(16)
    with cpu_executor.enabled(self_check=True, sources=_plant(*WRONG_GELU)):
        got = ops.bias_gelu(x, b)
    assert not torch.allclose(got, torch.nn.functional.gelu(x + b, approximate="tanh"), atol=1e-3)
    assert self_check.RESULTS == {}


def test_the_environment_switch_turns_the_executor_on_for_a_process(monkeypatch):
    """AUTOSHARD_CUDA_ON_CPU=run-ahead in a fresh process: the fused ops run their kernels, run-ahead."""
    code = ("import torch; from autoshard.kernels import ops, cpu_executor; from autoshard.kernels.launch import LAUNCHES; "
            "y = ops.rms_norm(torch.randn(4, 64), torch.ones(64)); "
            "print(cpu_executor.active().schedule, dict(LAUNCHES))")
    env = {**os.environ, "AUTOSHARD_CUDA_ON_CPU": "run-ahead"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "run-ahead {'norm_fwd': 1}", out.stdout + out.stderr
    monkeypatch.setenv("AUTOSHARD_CUDA_ON_CPU", "0")
    assert _from_environment() is None
