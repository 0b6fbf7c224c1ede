"""The GPU acceptance command (`./run gpu-check`, benchmarks/gpu_check.py): every file a stage runs
exists (the script it replaced named test files a redesign had moved), the stages that need a GPU
are skipped without one and said so, and an unknown stage is refused."""
import importlib.util
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _module():
    spec = importlib.util.spec_from_file_location("gpu_check", os.path.join(ROOT, "benchmarks", "gpu_check.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = mod              # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def test_every_path_a_stage_runs_exists():
    mod = _module()
    for stage in mod.STAGES:
        assert stage.paths, stage.name
        for path in stage.paths:
            assert os.path.isfile(os.path.join(ROOT, path)), f"stage {stage.name} runs {path}, which does not exist"
            assert any(path in part for part in stage.command), (stage.name, path)


def test_without_a_gpu_only_the_cpu_stages_run():
    mod = _module()
    run, skipped = mod.plan([], gpu=False)
    assert [s.name for s in run] == ["cpu"]
    assert {s.name for s in skipped} == {"kernels", "fused", "train", "fp8", "bench-kernels", "bench-mfu",
                                         "bench-launch", "bench-layers"}
    run, skipped = mod.plan(["train", "cpu"], gpu=True)
    assert [s.name for s in run] == ["cpu", "train"] and skipped == []
    with pytest.raises(SystemExit, match="unknown stage"):
        mod.plan(["check"], gpu=True)


def test_a_stage_past_its_timeout_is_stopped_with_its_children(tmp_path):
    """--timeout: a stage that hangs (here a child process that sleeps, as a torchrun worker might)
    is killed, group and all, and counts as failed; a quick one runs to its end."""
    mod = _module()
    child = "import subprocess, sys; subprocess.run([sys.executable, '-c', 'import time; time.sleep(60)'])"
    hang = mod.Stage("hang", False, ("-c", f"print('started', flush=True); {child}"), ())
    with open(tmp_path / "hang.log", "w") as log:
        assert mod._run_stage(hang, dict(os.environ), log, timeout=1.0) != 0
    text = (tmp_path / "hang.log").read_text()
    assert "started" in text and "stage hang stopped after its 1 s" in text, text
    quick = mod.Stage("quick", False, ("-c", "print('done')"), ())
    with open(tmp_path / "quick.log", "w") as log:
        assert mod._run_stage(quick, dict(os.environ), log, timeout=30.0) == 0
    assert "stopped" not in (tmp_path / "quick.log").read_text()
