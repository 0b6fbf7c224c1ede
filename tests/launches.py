"""The suite's checker launches, scheduled across test files: one torchrun launch per world size.

A test that needs a checker run on real processes declares a `Job` (checker module, arguments, world
size) and reads its result through the `launched` fixture (tests/conftest.py):

    JOB = Job("zero/dp4", "tests.harness.zero_check", ("--dp", "4"), world=4)

    @needs(JOB)
    def test_something(launched):
        lines = launched(JOB)            # the JSON lines the checker's rank 0 printed

or, parametrized, `@pytest.mark.parametrize("mesh", job_params(JOBS))` over a dict of jobs.

The first request for a world size runs, in one launch (tests/harness/jobs.py: one process group,
each checker's `main()` in turn), every job of that world size that the *selected* tests declare
(after -k / -m, over every file), in the order the tests were collected. Each job's lines are filed
in the run's shared folder, where later requests read them, from this process or from another
pytest-xdist worker (a lock per world size: one launch at a time for each). A torch import and a
process group then cost one launch per world size, not one per file or test.

Jobs that must see one another's files (a checkpoint saved by one and loaded by the next) name the
same `folder`: "{dir}" in their arguments becomes that folder, and they run in declaration order.
`before` runs in the launching process ahead of the launch (a single-device reference written to
the job's folder, for instance).
"""
from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import tempfile
import time
import traceback
from dataclasses import dataclass
from typing import Callable

import pytest

from autoshard.testing.launch import json_lines, run_local, torchrun

__all__ = ["Job", "Scheduler", "job_params", "launched", "needs"]


@dataclass(frozen=True)
class Job:
    name: str                     # unique in the suite: names its result file
    module: str                   # a checker run through launch.run_checker
    argv: tuple[str, ...]
    world: int
    folder: str | None = None     # "{dir}" in argv: this scratch folder, shared by jobs naming it
    before: Callable[[pathlib.Path], None] | None = None     # run with the folder before the launch
    seconds: int = 300            # this job's share of the launch's timeout
    local: bool = True            # on a LocalWorld in this process (autoshard/world/local.py); False: torchrun, gloo

    def args(self, folder: pathlib.Path) -> list[str]:
        return [a.replace("{dir}", str(folder)) for a in self.argv]


MARK = "launches"


def needs(*jobs: Job) -> pytest.MarkDecorator:
    """Mark a test as reading these jobs' results, so a run that selects it launches them."""
    return getattr(pytest.mark, MARK)(*jobs)


def job_params(jobs: dict[str, Job]) -> list:
    """Parametrize over `jobs`' keys, each parameter marked with its job."""
    return [pytest.param(key, id=key, marks=needs(job)) for key, job in jobs.items()]


_SELECTED: list[Job] = []


@pytest.hookimpl(trylast=True)          # after -k / -m: only the selected tests' jobs are launched
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Remember the jobs of the selected tests, in collection order."""
    seen: dict[str, Job] = {}
    for item in items:
        for mark in item.iter_markers(MARK):
            for job in mark.args:
                if seen.setdefault(job.name, job) != job:
                    raise pytest.UsageError(f"two launch jobs are named {job.name!r}: {seen[job.name]} and {job}")
    _SELECTED[:] = list(seen.values())


def _file_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name)


class Scheduler:
    """Files each job's result under `root` (shared by the run's pytest-xdist workers)."""

    def __init__(self, root: pathlib.Path):
        self.root = root
        (root / "results").mkdir(parents=True, exist_ok=True)

    def folder(self, job: Job) -> pathlib.Path:
        """The job's scratch folder ("{dir}")."""
        path = self.root / "folders" / _file_name(job.folder or job.name)
        path.mkdir(parents=True, exist_ok=True)
        return path

    def _result(self, job: Job) -> pathlib.Path:
        return self.root / "results" / f"{_file_name(job.name)}.json"

    def __call__(self, job: Job) -> list[dict]:
        """The JSON lines `job`'s rank 0 printed; the first request of a world size launches it."""
        import filelock

        path = self._result(job)
        if job.local and not path.exists():
            with filelock.FileLock(str(self.root / f"{_file_name(job.folder or job.name)}.lock")):
                if not path.exists():        # with the jobs sharing its folder declared before it, in order
                    kin = [j for j in _SELECTED if j.local and j.folder and j.folder == job.folder]
                    for j in (kin[: kin.index(job) + 1] if job in kin else [job]):
                        if not self._result(j).exists():
                            self._run_local(j)
        if not path.exists():
            with filelock.FileLock(str(self.root / f"world-{job.world}.lock")):
                if not path.exists():
                    batch = [j for j in _SELECTED if j.world == job.world and not j.local and not self._result(j).exists()]
                    self._launch(batch if job in batch else [*batch, job])
        result = json.loads(path.read_text())
        if "error" in result:
            pytest.fail(result["error"], pytrace=False)
        return result["lines"]

    def _run_local(self, job: Job) -> None:
        """`job` on a LocalWorld of its world size, in this process (its lines filed as a launch's)."""
        if job.before is not None:
            job.before(self.folder(job))
        start = time.perf_counter()
        try:
            stdout, ok = run_local(job.module, job.args(self.folder(job)), job.world)
            result = {"lines": json_lines(stdout), "seconds": round(time.perf_counter() - start, 1)}
            if not ok:
                result = {"error": f"local job {job.name} failed on some rank ({job.module} {' '.join(job.argv)})\n"
                                   f"{stdout[-3000:]}"}
        except Exception:           # noqa: BLE001 (filed for every test reading the job)
            result = {"error": f"local job {job.name} raised ({job.module} {' '.join(job.argv)}):\n"
                               f"{traceback.format_exc()[-4000:]}"}
        partial = self._result(job).with_suffix(".partial")
        partial.write_text(json.dumps(result))
        os.replace(partial, self._result(job))

    def _launch(self, batch: list[Job]) -> None:
        world = batch[0].world
        for job in batch:
            if job.before is not None:
                job.before(self.folder(job))
        with tempfile.NamedTemporaryFile("w", suffix=".json", dir=self.root, delete=False) as f:
            json.dump([(job.module, job.args(self.folder(job))) for job in batch], f)
        try:
            proc = torchrun("tests.harness.jobs", [f.name], world, timeout=sum(j.seconds for j in batch))
            stdout, said = proc.stdout, f"exit status {proc.returncode}"
        except subprocess.TimeoutExpired as e:
            stdout = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            proc, said = None, f"stopped after {e.timeout:.0f} s"
        os.unlink(f.name)
        per_job: list[list[dict]] = [[] for _ in batch]
        done: dict[int, float] = {}         # job -> its seconds in the launch
        current = None
        for line in json_lines(stdout):
            if set(line) == {"job"}:
                current = line["job"]
            elif set(line) == {"done", "seconds"}:
                done[line["done"]] = line["seconds"]
            elif current is not None:
                per_job[current].append(line)
        tail = stdout[-3000:] + (proc.stderr[-3000:] if proc is not None else "")
        names = [job.name for job in batch]
        for i, (job, lines) in enumerate(zip(batch, per_job)):
            if i in done:
                result = {"lines": lines, "seconds": done[i]}
            else:
                result = {"error": f"launch job {job.name} did not finish ({job.module} {' '.join(job.argv)}): "
                                   f"the world-{world} launch of {names} ended ({said}) in or before it\n{tail}"}
            partial = self._result(job).with_suffix(".partial")       # another worker reads it without the lock:
            partial.write_text(json.dumps(result))                     # it appears whole or not at all
            os.replace(partial, self._result(job))


@pytest.fixture(scope="session")
def launched(tmp_path_factory: pytest.TempPathFactory) -> Scheduler:
    """`launched(job)`: the job's JSON lines; `launched.folder(job)`: its scratch folder. Results live
    in the run's base temporary folder, which the run's pytest-xdist workers share."""
    base = tmp_path_factory.getbasetemp()
    return Scheduler((base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "launches")
