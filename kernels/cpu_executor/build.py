"""Building the CPU executor: each kernel file compiled by the host C++ compiler against
cuda_on_cpu.h (with g++'s alignment check), the scheduler beside them, linked into one shared
library, cached by the hash of everything that goes into it ($AUTOSHARD_KERNEL_CACHE, else
~/.cache/autoshard/cpu-kernels)."""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Mapping
from pathlib import Path

from autoshard.kernels.build import _DIR as _CUDA_DIR
from autoshard.kernels.build import KERNELS, STORAGE
from autoshard.kernels.cpu_executor.config import ExecutorUnavailable, KernelExecutionError
from autoshard.kernels.cpu_executor.library import Library

__all__ = ["compiler", "library"]

_HOST_DIR = Path(__file__).parent
# kernel sources: g++'s alignment check, trapping (no runtime library); no FMA contraction, so a
# result does not depend on the host's instruction set; no fortified longjmp (fibers switch stacks)
_KERNEL_FLAGS = ("-std=c++17", "-O2", "-fPIC", "-ffp-contract=off", "-fsanitize=alignment",
                 "-fsanitize-undefined-trap-on-error", "-U_FORTIFY_SOURCE", "-Wno-unknown-pragmas")
_EXECUTOR_FLAGS = ("-std=c++17", "-O2", "-fPIC", "-U_FORTIFY_SOURCE")


def compiler() -> str | None:
    """The host C++ compiler the executor uses ($CXX, else g++), or None when there is none."""
    return shutil.which(os.environ.get("CXX", "g++"))


def _translation_unit(file: str, sources: Mapping[str, str]) -> str:
    """One kernel file as the host compiles it: the host header, common.cuh, the file (with #line
    so messages and barrier sites name the real files), then one registration per template and
    storage type."""
    text = {f: sources.get(f) or (_CUDA_DIR / f).read_text() for f in ("common.cuh", file)}
    registrations = "\n".join(f"EMU_KERNEL({k}, {t})" for k in KERNELS[file] for t in STORAGE.values())
    return (f'#include "cuda_on_cpu.h"\n#line 1 "common.cuh"\n{text["common.cuh"]}\n'
            f'#line 1 "{file}"\n{text[file]}\n#line 1 "registrations"\n{registrations}\n')


def _cache_dir() -> Path:
    root = os.environ.get("AUTOSHARD_KERNEL_CACHE") or Path.home() / ".cache" / "autoshard" / "cpu-kernels"
    return Path(root)


def _build(units: dict[str, str], cxx: str, out: Path) -> None:
    with tempfile.TemporaryDirectory(prefix="autoshard-cpu-kernels-") as tmp:
        tmp = Path(tmp)
        jobs, objects = [], []
        for name, text in units.items():
            src, obj = tmp / f"{name}.cpp", tmp / f"{name}.o"
            src.write_text(text)
            flags = _EXECUTOR_FLAGS if name == "executor" else _KERNEL_FLAGS
            cmd = [cxx, *flags, "-I", str(_HOST_DIR), "-c", str(src), "-o", str(obj)]
            jobs.append((name, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)))
            objects.append(str(obj))
        logs = [(name, p.communicate()[0], p.returncode) for name, p in jobs]
        failed = [(name, log) for name, log, status in logs if status]
        if failed:
            raise KernelExecutionError("the CPU executor does not build:\n" + "\n".join(f"{n}:\n{log[:4000]}" for n, log in failed))
        partial = tmp / "lib.so"
        link = subprocess.run([cxx, "-shared", "-o", str(partial), *objects], capture_output=True, text=True)
        if link.returncode:
            raise KernelExecutionError(f"the CPU executor does not link:\n{link.stdout}{link.stderr}")
        out.parent.mkdir(parents=True, exist_ok=True)
        staged = out.with_suffix(f".{os.getpid()}.tmp")
        shutil.copyfile(partial, staged)
        os.replace(staged, out)                 # atomic: a concurrent build never sees half a file


@functools.cache
def _library_at(path: str) -> Library:
    return Library(ctypes.CDLL(path))


def library(sources: Mapping[str, str] | None = None) -> Library:
    """The executor with every kernel file built in (and `sources` replacing files, to plant bugs),
    built on first use and cached by the hash of everything that goes into it; in a process, found
    once per set of replaced files (every launch asks for it)."""
    cxx = compiler()
    if cxx is None:
        raise ExecutorUnavailable("no host C++ compiler (g++ or $CXX) to build the CPU executor of the CUDA "
                                  "kernels; install g++ (apt install g++)")
    return _library_for(cxx, tuple(sorted((sources or {}).items())))


@functools.cache
def _library_for(cxx: str, sources: tuple[tuple[str, str], ...]) -> Library:
    units = {Path(f).stem: _translation_unit(f, dict(sources)) for f in KERNELS}
    units["executor"] = (_HOST_DIR / "executor.cpp").read_text()
    digest = hashlib.sha256()
    for part in (cxx, subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout,
                 (_HOST_DIR / "cuda_on_cpu.h").read_text(), *_KERNEL_FLAGS, *_EXECUTOR_FLAGS,
                 *(f"{k}\0{v}" for k, v in sorted(units.items()))):
        digest.update(part.encode() + b"\0")
    path = _cache_dir() / f"kernels-{digest.hexdigest()[:20]}.so"
    if not path.is_file():
        _build(units, cxx, path)
    return _library_at(str(path))
