"""A command run in the test's own process, as its own process would run it: the exit status and
what it printed, without an interpreter, a torch import or an export of its own. What such a
command may change in the process is given back after: the random state, torch's thread count,
sys.argv and sys.path.

    proc = run_here(lambda: command(argv), ["autoshard", "train", *argv])    # a CompletedProcess
"""
from __future__ import annotations

import contextlib
import io
import subprocess
import sys
from typing import Callable

import torch

__all__ = ["run_here"]


def run_here(fn: Callable[[], object], argv: list[str], path: str | None = None) -> subprocess.CompletedProcess:
    """fn() with sys.argv = `argv` (and `path` first on sys.path): its int result, or SystemExit's
    status as Python gives it (None: 0; a message: 1, said on stderr), or 0."""
    out, err = io.StringIO(), io.StringIO()
    threads, saved_argv, saved_path = torch.get_num_threads(), sys.argv, list(sys.path)
    try:
        sys.argv = list(argv)
        if path is not None:
            sys.path.insert(0, path)
        with torch.random.fork_rng(), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            result = fn()
        code = result if isinstance(result, int) else 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else int(e.code is not None)
        if e.code is not None and not isinstance(e.code, int):
            print(e.code, file=err)
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
        torch.set_num_threads(threads)
    return subprocess.CompletedProcess(argv, code, out.getvalue(), err.getvalue())
