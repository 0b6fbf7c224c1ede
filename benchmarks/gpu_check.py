"""The one command a machine with a GPU runs to accept a build: `./run gpu-check [STAGE ...]`.

Stages, in order (each a command; a device call may run 10 minutes, so name a few at a time there,
with --timeout; the first GPU session ran kernels, fused, train and bench-mfu in 229 s, bench-kernels
in under 95 s):

    cpu            the CUDA sources on the CPU executor: kernels, slots, the fusion fuzz (no GPU needed)
    kernels        every kernel against float64 on CUDA, forward and backward, and the fusion fuzz on CUDA
    fused          fused rank programs against unfused ones on CUDA (simulation: all ranks on one GPU)
    train          `autoshard train` on one GPU (bf16, fused, NCCL), and its exported folder trained again
    fp8            precision="fp8" on CUDA: the tp=2 program against the single-device FP8 one, and the
                   CPU's losses against the GPU's (tests/gpu/test_fp8_cuda.py)
    bench-kernels  benchmarks/kernels.py: each kernel's bandwidth against the copy rate (RESULTS.md)
    bench-mfu      benchmarks/mfu.py --fused --fp8: a 1.3B GPT's step time and model FLOP utilization,
                   fused, unfused and FP8 beside the plain model (RESULTS.md)
    bench-launch   benchmarks/launch_overhead.py: each fused op's host time per call against eager's
    bench-layers   benchmarks/launch_layers.py: one fused op's host time taken apart, layer by layer

Without a GPU the stages that need one are skipped, and the command says which. Logs go to $OUT
(the device tool brings that folder back) or ./gpu_out, with RESULTS.md copied there after the
benchmarks. Exit status: 0 when every stage that ran passed.
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Stage:
    name: str
    needs_gpu: bool
    command: tuple[str, ...]        # run from the repository root with this Python
    paths: tuple[str, ...]          # what it runs (a unit test keeps each existing)


def _pytest(*paths: str, extra: tuple[str, ...] = ()) -> tuple[str, ...]:
    return ("-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *extra, *paths)


_CPU_TESTS = ("tests/unit/test_cpu_executor.py", "tests/unit/test_kernel_slots.py",
              "tests/simulation/test_fusion_fuzz.py")
_KERNEL_TESTS = ("tests/gpu/test_cuda_kernels.py", "tests/gpu/test_fusion_fuzz_cuda.py")
STAGES = (
    Stage("cpu", False, _pytest(*_CPU_TESTS), _CPU_TESTS),
    Stage("kernels", True, _pytest(*_KERNEL_TESTS), _KERNEL_TESTS),
    Stage("fused", True, _pytest("tests/simulation/test_fuse.py", extra=("-k", "cuda")),
          ("tests/simulation/test_fuse.py",)),
    Stage("train", True, _pytest("tests/gpu/test_train_cuda.py"), ("tests/gpu/test_train_cuda.py",)),
    Stage("bench-kernels", True, ("benchmarks/kernels.py", "--append"), ("benchmarks/kernels.py",)),
    Stage("fp8", True, _pytest("tests/gpu/test_fp8_cuda.py"), ("tests/gpu/test_fp8_cuda.py",)),
    Stage("bench-mfu", True, ("benchmarks/mfu.py", "--fused", "--fp8", "--append"), ("benchmarks/mfu.py",)),
    Stage("bench-launch", True, ("benchmarks/launch_overhead.py", "--calls", "500", "--append"),
          ("benchmarks/launch_overhead.py",)),
    Stage("bench-layers", True, ("benchmarks/launch_layers.py", "--append"), ("benchmarks/launch_layers.py",)),
)


def has_gpu() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def plan(names: list[str], gpu: bool) -> tuple[list[Stage], list[Stage]]:
    """(stages to run, stages skipped for want of a GPU), in the table's order."""
    unknown = sorted(set(names) - {s.name for s in STAGES})
    if unknown:
        raise SystemExit(f"gpu-check: unknown stage(s) {', '.join(unknown)}; stages: "
                         f"{', '.join(s.name for s in STAGES)}")
    chosen = [s for s in STAGES if not names or s.name in names]
    return [s for s in chosen if gpu or not s.needs_gpu], [s for s in chosen if s.needs_gpu and not gpu]


def _describe_machine(out: Path) -> None:
    lines = []
    if shutil.which("nvidia-smi"):
        query = "--query-gpu=name,memory.total,clocks.sm,clocks.mem,temperature.gpu"
        lines.append(subprocess.run(["nvidia-smi", query, "--format=csv"], capture_output=True, text=True).stdout)
    probe = ("import torch; print('torch', torch.__version__, '| cuda', torch.version.cuda, '|', "
             "torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU')")
    lines.append(subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True).stdout)
    try:
        import cupy
        lines.append(f"cupy {cupy.__version__}\n")
    except ImportError:
        lines.append("cupy: not installed (the fused ops run their torch implementations on CUDA)\n")
    text = "".join(lines)
    print(text, end="", flush=True)
    (out / "machine.txt").write_text(text)


def _run_stage(stage: Stage, env: dict[str, str], log, timeout: float | None) -> int:
    """Run one stage, its output to the terminal and `log`; its exit status (-9 when stopped at `timeout`)."""
    proc = subprocess.Popen([sys.executable, *stage.command], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    stopped = threading.Event()

    def stop() -> None:                     # the whole process group: torchrun's workers too
        stopped.set()
        os.killpg(proc.pid, signal.SIGKILL)

    timer = threading.Timer(timeout, stop) if timeout else None
    if timer:
        timer.start()
    for line in proc.stdout:
        print(line, end="", flush=True)
        log.write(line)
    rc = proc.wait()
    if timer:
        timer.cancel()
    if stopped.is_set():
        note = f"gpu-check: stage {stage.name} stopped after its {timeout:.0f} s (--timeout)\n"
        print(note, end="", flush=True)
        log.write(note)
    return rc


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("stages", nargs="*", help="stages to run (default: all)")
    ap.add_argument("--list", action="store_true", help="print the stages and their commands, run nothing")
    ap.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                    help="each stage's limit: a stage still running then is stopped and counts as failed "
                         "(a device call has minutes: one slow stage must not take the others' time)")
    args = ap.parse_args()
    gpu = has_gpu()
    run, skipped = plan(args.stages, gpu)
    if args.list:
        for s in STAGES:
            print(f"{s.name:14} {'GPU' if s.needs_gpu else 'CPU'}  python {' '.join(s.command)}")
        return 0
    out = Path(os.environ.get("OUT") or ROOT / "gpu_out")
    out.mkdir(parents=True, exist_ok=True)
    _describe_machine(out)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    failed = []
    for s in run:
        print(f"== gpu-check {s.name}: python {' '.join(s.command)}", flush=True)
        with open(out / f"{s.name}.log", "w") as log:
            if _run_stage(s, env, log, args.timeout) != 0:
                failed.append(s.name)
    if any(s.name.startswith("bench-") for s in run):
        shutil.copy(ROOT / "benchmarks" / "RESULTS.md", out / "RESULTS.md")
    print(f"gpu-check: ran {', '.join(s.name for s in run) or 'nothing'}"
          + (f"; failed: {', '.join(failed)}" if failed else "; all passed")
          + (f"; skipped (no GPU here): {', '.join(s.name for s in skipped)}" if skipped else ""), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
