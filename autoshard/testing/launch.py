"""What every torchrun checker does around its checks (agree on verdicts, report, leave cleanly), and
the one way tests and the demo launch them (torchrun, torchrun_lines; tests/launches.py runs several
checkers in one launch through it)."""
from __future__ import annotations

import contextlib
import importlib
import io
import json
import os
import subprocess
import sys
from typing import Callable, NoReturn

import torch
import torch.distributed as dist

from autoshard.world import LocalWorld, current

__all__ = ["agree", "init_gloo", "json_lines", "leave", "run_checker", "run_local", "shared_ok", "start_shared",
           "torchrun", "torchrun_lines"]


def agree(result: dict, good: bool) -> bool:
    """True when every rank's check passed; rank 0 prints `result` as one JSON line."""
    flags = torch.tensor([0 if good else 1])
    current().all_reduce(flags)
    everyone = int(flags.item()) == 0
    if current().rank() == 0:
        print(json.dumps({**result, "all_ranks_ok": everyone}), flush=True)
    return everyone


def init_gloo() -> None:
    """The WORLD group. Under torchrun --max-restarts, a restarted job reuses the agent's store, where
    the first attempt's ranks left their addresses; a fast rank could read a dead peer's address
    before the peer rewrites it. Keys are therefore prefixed with the attempt number."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    # no agent store to join where the agents do not share theirs (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1,
    # README "A lost node"): rank 0 hosts a new one, as init_process_group makes it
    if attempt is None or "MASTER_ADDR" not in os.environ or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group("gloo")
        return
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False)
    dist.init_process_group("gloo", store=dist.PrefixStore(f"attempt-{attempt}", store), rank=rank, world_size=world)


_SHARED: list[bool] = []       # inside tests/harness/jobs.py: the verdicts of the checks run so far


def start_shared() -> None:
    """One process group for several checkers in turn (tests/harness/jobs.py): from here on
    run_checker records each verdict (`shared_ok`) instead of making a group and exiting."""
    init_gloo()
    _SHARED.append(True)


def shared_ok() -> bool:
    return all(_SHARED)


def run_checker(main: Callable[[], bool]) -> None:
    """Run `main` in a gloo process group and exit 0 if it returns True on every rank. Inside a
    launch that runs several checks (tests/harness/jobs.py) the group is already there: the verdict
    is recorded and the process goes on to the next check."""
    if _SHARED:
        _SHARED.append(bool(main()))
        current().barrier()
        return
    init_gloo()
    leave(0 if main() else 1)


def run_local(module: str, argv: list[str], world: int) -> tuple[str, bool]:
    """The checker `module` (its `main()`, or "module:function") on `world` ranks of a LocalWorld in
    this process, each rank a thread running what a torchrun process runs: what its ranks printed,
    and whether every rank's check passed. A rank that raises raises here, noted with its rank."""
    name, _, entry = module.partition(":")
    fn = getattr(importlib.import_module(name), entry or "main")
    argv_before, verdicts_before = sys.argv, list(_SHARED)
    sys.argv = [name, *argv]
    _SHARED[:] = [True]                   # run_checker records each rank's verdict (as in a shared launch)
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            LocalWorld(world).run(lambda rank: fn())
        return out.getvalue(), all(_SHARED)
    finally:
        sys.argv = argv_before
        _SHARED[:] = verdicts_before


def leave(code: int) -> NoReturn:
    """End a torchrun process whose work is done: wait for every rank, close the process group and
    exit with `code` without the interpreter's finalization. Gloo's worker threads can still hold
    tensors while the interpreter finalizes, which aborts (SIGABRT, "terminate called without an
    active exception") in about one exit in four here; whatever the process had to say is said."""
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def torchrun(target: str, args: list[str], world: int, *, timeout: int = 600, max_restarts: int = 0,
             cwd: str | None = None, rendezvous: list[str] | None = None) -> subprocess.CompletedProcess:
    """Run `target` under torchrun on `world` gloo processes (one thread each): a module name
    (`tests.harness.zero_check`, run with -m) or a script path (ending in .py). Every test and the
    demo launch through here, so the command is built in one place. `rendezvous`: torchrun's flags
    to meet other machines' agents (then `world` is this machine's processes), else --standalone."""
    run = [target] if target.endswith(".py") else ["-m", target]
    restarts = [f"--max-restarts={max_restarts}"] if max_restarts else []
    cmd = [sys.executable, "-m", "torch.distributed.run", *(rendezvous or ["--standalone"]),
           f"--nproc-per-node={world}", *restarts, *run, *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def json_lines(stdout: str) -> list[dict]:
    """The JSON lines a checker's rank 0 printed."""
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


def torchrun_lines(target: str, args: list[str], world: int, **options) -> list[dict]:
    """`torchrun(...)`, asserting it exits 0; returns the JSON lines rank 0 printed."""
    proc = torchrun(target, args, world, **options)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json_lines(proc.stdout)
