"""The local world (autoshard/world/local.py): collectives, transfers, turns, deadlocks and errors,
and the seam itself: nothing outside the torch.distributed world talks over torch.distributed."""
import ast
import pathlib
import time

import pytest
import torch

from autoshard.world import P2P, DeadlockError, LocalWorld, current, run_ranks

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_collectives_give_every_rank_the_reduction_in_rank_order():
    def body(r):
        w = current()
        total = torch.tensor([r + 1.0, -r])
        w.all_reduce(total)
        pair = w.new_group([0, 1]), w.new_group([2, 3])
        top = torch.tensor([float(r)])
        w.all_reduce(top, op="max", group=pair[r // 2])
        gathered = torch.empty(4, 2)
        w.all_gather(gathered, torch.full((1, 2), float(r)))
        mine = torch.empty(1, 2)
        w.reduce_scatter(mine, torch.arange(8.0).view(4, 2) * (r + 1))
        rows = torch.empty(4)
        w.all_to_all(rows, torch.tensor([10.0 * r + j for j in range(4)]), [1] * 4, [1] * 4)
        return total.tolist(), top.item(), gathered[:, 0].tolist(), mine.tolist(), rows.tolist(), w.gather_objects(r)
    out = run_ranks(4, body)
    for r, (total, top, gathered, mine, rows, objs) in enumerate(out):
        assert total == [10.0, -6.0] and top == (1.0 if r < 2 else 3.0) and gathered == [0, 1, 2, 3]
        assert mine == [[20.0 * r, 20.0 * r + 10]] and rows == [r, 10.0 + r, 20.0 + r, 30.0 + r] and objs == [0, 1, 2, 3]


def test_receives_take_messages_in_the_order_they_were_posted():
    def body(r):
        w = current()
        if r == 0:
            w.p2p([P2P(True, torch.tensor([1.0]), 1, tag=3), P2P(True, torch.tensor([2.0]), 1, tag=3),
                   P2P(True, torch.tensor([9.0]), 1, tag=4)])
            return None
        first, second, other = torch.empty(1), torch.empty(1), torch.empty(1)
        works = w.p2p([P2P(False, other, 0, tag=4), P2P(False, first, 0, tag=3), P2P(False, second, 0, tag=3)])
        for work in reversed(works):
            work.wait()
        return first.item(), second.item(), other.item()
    assert run_ranks(2, body)[1] == (1.0, 2.0, 9.0)


def test_a_receive_before_the_peer_sends_is_a_deadlock_named_at_once():
    def body(r):
        got = torch.empty(2)
        current().p2p([P2P(False, got, 1 - r, tag=7)])[0].wait()
        current().p2p([P2P(True, got, 1 - r, tag=7)])
    start = time.perf_counter()
    with pytest.raises(DeadlockError, match=r"rank 0 waits on a message from rank 1 \(tag 7\); "
                                            r"rank 1 waits on a message from rank 0 \(tag 7\)"):
        run_ranks(2, body)
    assert time.perf_counter() - start < 5


def test_a_collective_a_rank_never_joins_names_that_rank():
    def body(r):
        if r != 2:
            current().all_reduce(torch.ones(1))
    with pytest.raises(DeadlockError, match=r"all_reduce\(sum\) #0 of world, which rank \[2\] never joined"):
        run_ranks(3, body)


def test_mismatched_collectives_and_failing_ranks_are_errors_not_hangs():
    def mismatched(r):
        if r == 0:
            current().all_reduce(torch.ones(2))
        else:
            current().all_gather(torch.empty(2), torch.ones(1))
    with pytest.raises(RuntimeError, match=r"rank 1 calls all_gather.*rank 0 called all_reduce"):
        run_ranks(2, mismatched)

    def failing(r):
        if r == 1:
            raise ValueError("boom")
        current().barrier()
    with pytest.raises(ValueError, match="boom") as info:
        run_ranks(3, failing)
    assert "(on rank 1 of a local world of 3)" in info.value.__notes__
    world = LocalWorld(2)
    assert world.run(lambda r: current().rank() * 10) == [0, 10]        # a world runs again after a run


def test_a_rank_alone_needs_no_process_group():
    t = torch.tensor([3.0])
    current().all_reduce(t)
    assert t.item() == 3.0 and current().size() == 1
    with pytest.raises(DeadlockError, match="no other rank"):
        current().p2p([P2P(False, torch.empty(1), 0, tag=1)])[0].wait()


# Modules that may import torch.distributed: the seam's own implementation, and what sets up a
# process group or measures torch.distributed itself (not communication of autoshard's).
ALLOWED = {
    "autoshard/world/torch_world.py": "the seam's torch.distributed implementation",
    "autoshard/testing/launch.py": "init_process_group, destroy_process_group (launch)",
    "autoshard/train/loop.py": "init_process_group (launch)",
    "autoshard/train/__init__.py": "torchrun's elastic launcher (launch)",
    "autoshard/cpu_profile/collectives.py": "measures gloo's own collectives for the cost model",
}


def _imports_torch_distributed(path: pathlib.Path) -> bool:
    for node in ast.walk(ast.parse(path.read_text())):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                 else [f"{node.module}.{a.name}" for a in node.names] if isinstance(node, ast.ImportFrom) and node.module
                 else [])
        if any(n == "torch.distributed" or n.startswith("torch.distributed.") for n in names):
            return True
    return False


def test_only_the_seam_talks_over_torch_distributed():
    found = {str(p.relative_to(ROOT)) for folder in ("autoshard", "passes", "kernels") for p in (ROOT / folder).rglob("*.py")
             if _imports_torch_distributed(p)}
    assert found <= set(ALLOWED), sorted(found - set(ALLOWED))
    assert "autoshard/world/torch_world.py" in found
