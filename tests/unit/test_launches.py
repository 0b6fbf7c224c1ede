"""The suite's launch scheduler (tests/launches.py), without launching: which jobs a selection
launches, and how one launch's output is filed per job."""
import json
import subprocess

import pytest

from tests import launches
from tests.launches import Job, Scheduler


class _Item:
    def __init__(self, *jobs):
        self.marks = [pytest.mark.launches(*jobs).mark] if jobs else []

    def iter_markers(self, name):
        return [m for m in self.marks if m.name == name]


@pytest.fixture(autouse=True)
def _own_selection(monkeypatch):
    """The suite's own selection stays as it is (this process may run real launches after)."""
    monkeypatch.setattr(launches, "_SELECTED", [])


A2, B2 = Job("a", "m.a", ("--x", "{dir}"), 2, local=False), Job("b", "m.b", (), 2, local=False)
C4 = Job("c", "m.c", (), 4, local=False)


def _select(*items):
    launches.pytest_collection_modifyitems(list(items))


def test_a_launch_holds_the_selected_jobs_of_its_world_size_in_collection_order(tmp_path, monkeypatch):
    _select(_Item(B2), _Item(), _Item(C4, A2))
    launched = []

    def fake_torchrun(target, args, world, timeout):
        jobs = json.load(open(args[0]))
        launched.append((world, [module for module, _ in jobs]))
        out = []
        for i, (module, argv) in enumerate(jobs):
            out += [json.dumps({"job": i}), json.dumps({"module": module, "argv": argv}),
                    json.dumps({"done": i, "seconds": 1.0})]
        return subprocess.CompletedProcess([], 0, "\n".join(out), "")

    monkeypatch.setattr(launches, "torchrun", fake_torchrun)
    run = Scheduler(tmp_path)
    assert run(A2) == [{"module": "m.a", "argv": ["--x", str(run.folder(A2))]}]
    assert run(B2)[0]["module"] == "m.b" and run(C4)[0]["module"] == "m.c"
    assert launched == [(2, ["m.b", "m.a"]), (4, ["m.c"])]          # B2 was asked for second, launched once


def test_a_job_the_launch_died_in_fails_its_test_and_those_after_it(tmp_path, monkeypatch):
    _select(_Item(A2, B2))
    out = [json.dumps({"job": 0}), json.dumps({"ok": 1}), json.dumps({"done": 0, "seconds": 1.0}),
           json.dumps({"job": 1}), json.dumps({"partial": 1})]          # no "done": job 1 died
    monkeypatch.setattr(launches, "torchrun", lambda *a, **k: subprocess.CompletedProcess([], 1, "\n".join(out), "boom"))
    run = Scheduler(tmp_path)
    assert run(A2) == [{"ok": 1}]
    with pytest.raises(pytest.fail.Exception, match=r"(?s)launch job b did not finish .*exit status 1.*boom"):
        run(B2)


def test_two_jobs_of_one_name_are_refused():
    with pytest.raises(pytest.UsageError, match="two launch jobs are named 'a'"):
        _select(_Item(A2), _Item(Job("a", "m.other", (), 2)))


def tiny_checker() -> None:
    """A checker as run_checker runs one: every rank sums its rank over the world, rank 0 prints;
    rank 1 fails its check when asked to (--fail)."""
    import sys

    import torch

    from autoshard.testing.launch import agree, run_checker
    from autoshard.world import current

    def main() -> bool:
        total = torch.tensor([float(current().rank())])
        current().all_reduce(total)
        return agree({"sum": total.item(), "argv": sys.argv[1:]}, "--fail" not in sys.argv or current().rank() != 1)
    run_checker(main)


def test_a_local_job_runs_its_checker_on_a_local_world_in_this_process(tmp_path, monkeypatch):
    good, bad = (Job(name, "tests.unit.test_launches:tiny_checker", argv, 3) for name, argv in
                 (("good", ("--x",)), ("bad", ("--fail",))))
    _select(_Item(good, bad))
    monkeypatch.setattr(launches, "torchrun", lambda *a, **k: pytest.fail("a local job launched torchrun"))
    run = Scheduler(tmp_path)
    assert run(good) == [{"sum": 3.0, "argv": ["--x"], "all_ranks_ok": True}]
    with pytest.raises(pytest.fail.Exception, match="local job bad failed on some rank"):
        run(bad)
