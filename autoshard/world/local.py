"""N ranks in one process: the runtime of a whole mesh run by threads that take turns.

    results = LocalWorld(4).run(lambda rank: train(rank))     # train() calls current() as on torchrun

Each rank runs `fn(rank)` in a thread of its own whose `current()` world is its rank of this one.
One rank runs at a time: rank 0 first, and a rank runs until it waits, on a receive whose message
has not been sent or a collective some member has not joined, then hands the turn to the next rank
(in rank order) that can run. Execution is therefore deterministic (the same interleaving on every
run) and needs no timeout: when a rank must wait and no rank can run, no rank ever will, and every
rank's wait is reported as a `DeadlockError`, with which ranks a collective still misses. A rank
that raises stops the others; `run` raises its exception, noted with the rank.

Collectives meet by position: a group's k-th collective on each member is one operation, which
must be the same kind on the same shapes (a mismatch is an error naming both ranks, where a real
backend would hang or corrupt). The last member to join computes it, summing in group-rank order
(the order a two-rank gloo reduction has, so its results are the same to the bit there), and writes
every member's result in place, so `Work.wait()` only waits. Sends go into a mailbox and complete at
once; a receive takes the oldest message from its peer with its tag, in the order receives were
posted, as torch.distributed pairs them.
"""
from __future__ import annotations

import copy
import threading
from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from autoshard.world.protocol import DONE, P2P, Work
from autoshard.world.select import alone_with, use

__all__ = ["LocalWorld", "LocalGroup", "DeadlockError", "run_ranks"]


class DeadlockError(RuntimeError):
    """Every rank of a local world that has not finished waits on something no rank will do."""


class _Stopped(BaseException):
    """Unwinds a rank whose world stopped (another rank failed or the world deadlocked)."""


@dataclass(frozen=True)
class LocalGroup:
    index: int                    # creation order (-1: the whole world)
    ranks: tuple[int, ...]        # global ranks, in group-rank order

    def __repr__(self) -> str:
        return "world" if self.index < 0 else f"group{list(self.ranks)}"


@dataclass
class _Meeting:
    """One collective: what each member brought, and whether the last one has arrived."""
    kind: str
    spec: tuple
    size: int
    arrived: dict[int, tuple[Any, Callable[[Any], None]]] = field(default_factory=dict)   # group rank -> (payload, deliver)
    done: bool = False


class _Joined:
    """The Work of a collective: done once every member has joined."""

    def __init__(self, world: "LocalWorld", rank: int, meeting: _Meeting, what: Callable[[], str]):
        self.world, self.rank, self.meeting, self.what = world, rank, meeting, what

    def is_completed(self) -> bool:
        return self.meeting.done

    def wait(self) -> bool:
        self.world._block(self.rank, self.what, lambda: self.meeting.done)
        return True


class _Receive:
    """The Work of a receive: done once its message has been copied in."""

    def __init__(self, world: "LocalWorld", rank: int, key: tuple, into: torch.Tensor):
        self.world, self.rank, self.key, self.into, self.done = world, rank, key, into, False

    def fill(self, message: torch.Tensor) -> None:
        if message.shape != self.into.shape or message.dtype != self.into.dtype:
            raise RuntimeError(f"rank {self.rank} receives a {tuple(self.into.shape)} {self.into.dtype} tensor from "
                               f"rank {self.key[0]} (tag {self.key[2]}), which sent {tuple(message.shape)} {message.dtype}")
        self.into.copy_(message)
        self.done = True

    def is_completed(self) -> bool:
        return self.done

    def wait(self) -> bool:
        src, _, tag, _ = self.key
        self.world._block(self.rank, lambda: f"a message from rank {src} (tag {tag})", lambda: self.done)
        return True


class LocalWorld:
    """A world of `size` ranks in this process (module doc)."""

    def __init__(self, size: int):
        if size < 1:
            raise ValueError(f"a local world needs at least one rank, not {size}")
        self.size = size
        self.whole = LocalGroup(-1, tuple(range(size)))
        self._cv = threading.Condition()
        self._running = False
        self._turn = 0
        self._waits: dict[int, tuple[Callable[[], str], Callable[[], bool]]] = {}
        self._finished: set[int] = set()
        self._failure: BaseException | None = None
        self._groups: list[LocalGroup] = []
        self._meetings: dict[tuple[int, int], _Meeting] = {}
        self._mail: dict[tuple, deque] = defaultdict(deque)        # (src, dst, tag, group) -> messages
        self._posted: dict[tuple, deque] = defaultdict(deque)      # (src, dst, tag, group) -> receives
        self._ranks = [_LocalRank(self, r) for r in range(size)]

    def rank_world(self, rank: int) -> "_LocalRank":
        """Rank `rank`'s view of this world (what its thread's `current()` returns)."""
        return self._ranks[rank]

    # ---- running the ranks -------------------------------------------------------------------
    def run(self, fn: Callable[[int], Any]) -> list:
        """`fn(rank)` on every rank, each in its own thread as described above; every rank's result."""
        if self._running:
            raise RuntimeError("this local world is already running its ranks")
        self._running, self._turn, self._finished, self._failure = True, 0, set(), None
        results: list = [None] * self.size
        threads = [threading.Thread(target=self._rank_main, args=(r, fn, results), name=f"local-rank-{r}", daemon=True)
                   for r in range(self.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self._running = False
        failure, self._failure = self._failure, None
        if failure is not None:
            self._meetings.clear()
            self._mail.clear()
            self._posted.clear()
            raise failure
        return results

    def _rank_main(self, rank: int, fn: Callable[[int], Any], results: list) -> None:
        with self._cv:
            while self._turn != rank and self._failure is None:
                self._cv.wait()
        try:
            if self._failure is None:
                with use(self._ranks[rank]), torch.enable_grad():
                    results[rank] = fn(rank)
        except _Stopped:
            pass
        except BaseException as e:           # noqa: BLE001 (re-raised by run, on the calling thread)
            with self._cv:
                if self._failure is None:
                    e.add_note(f"(on rank {rank} of a local world of {self.size})")
                    self._failure = e
                self._cv.notify_all()
        finally:
            with self._cv:
                self._finished.add(rank)
                if self._failure is None:
                    self._pass_turn(rank)
                self._cv.notify_all()

    def _runnable(self, rank: int) -> bool:
        if rank in self._finished:
            return False
        wait = self._waits.get(rank)
        return wait is None or wait[1]()

    def _pass_turn(self, rank: int) -> None:
        """Give the turn to the next rank after `rank` that can run (`rank` itself last); with none,
        the world is deadlocked. Called holding the lock."""
        for k in range(1, self.size + 1):
            other = (rank + k) % self.size
            if self._runnable(other):
                self._turn = other
                self._cv.notify_all()
                return
        stuck = sorted(r for r in range(self.size) if r not in self._finished)
        if stuck:
            lines = [f"rank {r} waits on {self._waits[r][0]()}" for r in stuck if r in self._waits]
            done = f"; ranks {sorted(self._finished)} have finished" if self._finished else ""
            self._failure = DeadlockError(f"deadlock in a local world of {self.size} ranks: " + "; ".join(lines) + done)
            self._cv.notify_all()

    def _block(self, rank: int, what: Callable[[], str], ready: Callable[[], bool]) -> None:
        """Return once `ready()`; meanwhile the other ranks take their turns."""
        with self._cv:
            if ready():
                return
            if not self._running:
                raise DeadlockError(f"rank {rank} waits on {what()}, and no other rank of this "
                                    f"{self.size}-rank world is running")
            self._waits[rank] = (what, ready)
            try:
                self._pass_turn(rank)
                while not (self._turn == rank and ready()):
                    if self._failure is not None:
                        raise _Stopped()
                    self._cv.wait()
            finally:
                del self._waits[rank]

    # ---- meeting -----------------------------------------------------------------------------
    def _meet(self, rank: int, group: LocalGroup, seq: int, kind: str, spec: tuple, payload: Any,
              deliver: Callable[[Any], None], combine: Callable[[list], list]) -> _Joined:
        me = group.ranks.index(rank)
        with self._cv:
            meeting = self._meetings.setdefault((group.index, seq), _Meeting(kind, spec, len(group.ranks)))
            if (meeting.kind, meeting.spec) != (kind, spec):
                first = group.ranks[min(meeting.arrived)]
                raise RuntimeError(f"collective #{seq} of {group}: rank {rank} calls {kind}{spec}, but rank {first} "
                                   f"called {meeting.kind}{meeting.spec}")
            meeting.arrived[me] = (payload, deliver)
            if len(meeting.arrived) == meeting.size:
                outs = combine([meeting.arrived[i][0] for i in range(meeting.size)])
                for i in range(meeting.size):
                    meeting.arrived[i][1](outs[i])
                meeting.done = True
                del self._meetings[(group.index, seq)]

        def what() -> str:
            missing = [group.ranks[i] for i in range(meeting.size) if i not in meeting.arrived]
            return f"{kind} #{seq} of {group}, which rank{'s' * (len(missing) > 1)} {missing} never joined"
        return _Joined(self, rank, meeting, what)

    def _send(self, key: tuple, message: torch.Tensor) -> None:
        with self._cv:
            if self._posted[key]:
                self._posted[key].popleft().fill(message)
            else:
                self._mail[key].append(message)

    def _post(self, rank: int, key: tuple, into: torch.Tensor) -> _Receive:
        receive = _Receive(self, rank, key, into)
        with self._cv:
            if self._mail[key]:
                receive.fill(self._mail[key].popleft())
            else:
                self._posted[key].append(receive)
        return receive


def _sum(xs: list[torch.Tensor]) -> torch.Tensor:
    total = xs[0].clone()
    for x in xs[1:]:
        total += x
    return total


def _max(xs: list[torch.Tensor]) -> torch.Tensor:
    top = xs[0].clone()
    for x in xs[1:]:
        torch.maximum(top, x, out=top)
    return top


class _LocalRank:
    """One rank's World (world/protocol.py) in a LocalWorld."""

    backend = "local"

    def __init__(self, world: LocalWorld, rank: int):
        self.world, self.me = world, rank
        self._made = 0                           # groups made so far (every rank makes the same ones)
        self._seq: dict[int, int] = defaultdict(int)

    def __repr__(self) -> str:
        return f"rank {self.me} of a local world of {self.world.size}"

    def _group(self, group: LocalGroup | None) -> LocalGroup:
        g = self.world.whole if group is None else group
        if self.me not in g.ranks:
            raise RuntimeError(f"rank {self.me} uses {g}, which it is not a member of")
        return g

    def rank(self, group: LocalGroup | None = None) -> int:
        return self._group(group).ranks.index(self.me)

    def size(self, group: LocalGroup | None = None) -> int:
        return len((self.world.whole if group is None else group).ranks)

    def global_rank(self, group: LocalGroup | None, group_rank: int) -> int:
        return (self.world.whole if group is None else group).ranks[group_rank]

    def new_group(self, ranks: list[int]) -> LocalGroup:
        k, self._made = self._made, self._made + 1
        with self.world._cv:
            if k == len(self.world._groups):
                self.world._groups.append(LocalGroup(k, tuple(ranks)))
            group = self.world._groups[k]
        if group.ranks != tuple(ranks):
            raise RuntimeError(f"rank {self.me}'s group #{k} is {list(ranks)}, another rank's is {list(group.ranks)}: "
                               f"every rank must make the same groups in the same order")
        return group

    def _collective(self, group, kind: str, spec: tuple, payload: Any, deliver: Callable[[Any], None],
                    combine: Callable[[list], list], async_op: bool) -> Work | None:
        g = self._group(group)
        seq = self._seq[g.index]
        self._seq[g.index] += 1
        work = self.world._meet(self.me, g, seq, kind, spec, payload, deliver, combine)
        if async_op:
            return work
        work.wait()
        return None

    def all_reduce(self, t: torch.Tensor, op: str = "sum", group=None, async_op: bool = False) -> Work | None:
        reduce = {"sum": _sum, "max": _max}[op]
        return self._collective(group, f"all_reduce({op})", (tuple(t.shape), t.dtype), t.detach().clone(),
                                lambda r: t.detach().copy_(r), lambda xs: [reduce(xs)] * len(xs), async_op)

    def reduce_scatter(self, out: torch.Tensor, t: torch.Tensor, group=None, async_op: bool = False) -> Work | None:
        return self._collective(group, "reduce_scatter", (tuple(t.shape), t.dtype), t.detach().clone(),
                                lambda r: out.detach().copy_(r),
                                lambda xs: list(_sum(xs).chunk(len(xs))), async_op)

    def all_gather(self, out: torch.Tensor, t: torch.Tensor, group=None, async_op: bool = False) -> Work | None:
        return self._collective(group, "all_gather", (tuple(t.shape), t.dtype), t.detach().clone(),
                                lambda r: out.detach().copy_(r), lambda xs: [torch.cat(xs)] * len(xs), async_op)

    def all_to_all(self, out: torch.Tensor, t: torch.Tensor, out_splits: list[int], in_splits: list[int],
                   group=None) -> None:
        def combine(items: list) -> list:
            pieces = [list(x.split(splits)) for x, splits in items]            # pieces[i][j]: from i to j
            return [torch.cat([pieces[i][j] for i in range(len(items))]) for j in range(len(items))]
        self._collective(group, "all_to_all", (tuple(t.shape[1:]), t.dtype), (t.detach().clone(), list(in_splits)),
                         lambda r: out.detach().copy_(r), combine, False)

    def broadcast(self, t: torch.Tensor, src: int, group=None) -> None:
        g = self._group(group)
        root = g.ranks.index(src)
        self._collective(group, "broadcast", (tuple(t.shape), t.dtype, src), t.detach().clone(),
                         lambda r: t.detach().copy_(r), lambda xs: [xs[root]] * len(xs), False)

    def barrier(self, group=None) -> None:
        self._collective(group, "barrier", (), None, lambda r: None, lambda xs: xs, False)

    def gather_objects(self, obj: Any, group=None) -> list:
        box: list = []
        self._collective(group, "gather_objects", (), copy.deepcopy(obj), box.append,
                         lambda xs: [copy.deepcopy(xs) for _ in xs], False)
        return box[0]

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        box: list = []
        self._collective(None, "broadcast_object", (src,), copy.deepcopy(obj), box.append,
                         lambda xs: [copy.deepcopy(xs[src]) for _ in xs], False)
        return box[0]

    def p2p(self, ops: list[P2P]) -> list[Work]:
        works: list[Work] = []
        for o in ops:
            gid = -1 if o.group is None else o.group.index
            if o.send:
                self.world._send((self.me, o.peer, o.tag, gid), o.tensor.detach().clone())
                works.append(DONE)
            else:
                works.append(self.world._post(self.me, (o.peer, self.me, o.tag, gid), o.tensor))
        return works


def run_ranks(size: int, fn: Callable[[int], Any]) -> list:
    """`fn(rank)` on every rank of a new local world of `size` ranks; their results in rank order."""
    return LocalWorld(size).run(fn)


alone_with(lambda: LocalWorld(1).rank_world(0))         # current() outside torchrun and a local world
