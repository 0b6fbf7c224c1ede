"""The one gradient path on gloo processes (tests/harness/grad_path_check.py), against one device:
frozen parameters (an embedding, tied across stages at pp2; a whole layer; LoRA adapters on a frozen
base) stay bit-identical and the rest train as on one device, with AdamW and DistributedOptimizer;
two train_step calls before a step equal two backward passes on one device (SGD, both optimizers).
Before: at dp2 AdamW decayed a frozen embedding (1.4e-3 drift), DistributedOptimizer refused
frozen parameters, and accumulated steps were 0.5-0.8 off. The single-device results are computed
once, in the launching test process, before the launch (Job.before)."""
import functools
import pathlib

import pytest

from tests.harness.grad_path_check import CASES, write_references
from tests.launches import Job, job_params

pytestmark = pytest.mark.slow


def _references(meshes: tuple[str, ...], folder: pathlib.Path) -> None:
    write_references(str(folder / "references.pt"), list(meshes))


def _job(world: int, meshes: tuple[str, ...]) -> Job:
    return Job(f"grad-path/{world}", "tests.harness.grad_path_check",
               ("--meshes", *meshes, "--reference", "{dir}/references.pt"), world,
               before=functools.partial(_references, meshes))


# dp=2, pp=2 (GPT-2's embedding tied across the stages) and tp=2 x dp=2; the checker also has dp2pp2
JOBS = {"dp2+pp2": _job(2, ("dp2", "pp2")), "tp2dp2": _job(4, ("tp2dp2",))}


@pytest.mark.parametrize("key", job_params(JOBS))
def test_frozen_parameters_and_accumulation_equal_one_device(launched, key):
    job = JOBS[key]
    meshes = job.argv[1:job.argv.index("--reference")]
    lines = launched(job)
    assert [(r["mesh"], r["case"], r["optim"]) for r in lines] == [(m, how, o) for m in meshes for how, o in CASES]
    for r in lines:
        assert r["all_ranks_ok"] and r["frozen_identical"], r
    assert any(r["frozen_here"] for r in lines)
