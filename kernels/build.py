"""Kernel sources and their compilation: NVRTC through ctypes (no GPU needed) or CuPy (on a GPU).

Each `cuda/*.cu` file is compiled with `cuda/common.cuh` in front of it and its templates
instantiated for fp32, fp16 and bf16 storage (`name<float>`, `name<f16>`, `name<bf16>`).
`compile_cubin` builds a file for a GPU architecture on any machine with the NVRTC library (the
`nvidia-cuda-nvrtc-cu12` wheel, a test dependency), so CI catches a kernel that does not build;
`function` loads a kernel through CuPy on the current CUDA device. `compile_cubin` also returns
ptxas's report per kernel (registers, stack frame, spills, shared memory).
"""
from __future__ import annotations

import ctypes
import functools
import re
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["KERNELS", "STORAGE", "source", "name_expressions", "compile_cubin", "function", "KernelBuildError",
           "Resources"]

_DIR = Path(__file__).with_name("cuda")

# file -> the kernel templates it defines, read off the sources (`__global__ void name(`): a new .cu
# file in cuda/ is built, run by the CPU executor and checked with no list to extend here
KERNELS: dict[str, tuple[str, ...]] = {
    path.name: tuple(re.findall(r"__global__\s+void\s+(\w+)\s*\(", path.read_text()))
    for path in sorted(_DIR.glob("*.cu"))
}
# torch dtype name -> the storage type the templates take
STORAGE = {"float32": "float", "float16": "f16", "bfloat16": "bf16"}
_OPTIONS = ("--std=c++17",)


class KernelBuildError(RuntimeError):
    """A kernel source did not compile; the message carries the compiler's log."""


def source(file: str) -> str:
    if file not in KERNELS:
        raise KeyError(f"no kernel file {file!r}; known: {', '.join(KERNELS)}")
    return (_DIR / "common.cuh").read_text() + f"\n// ---- {file}\n" + (_DIR / file).read_text()


def name_expressions(file: str) -> list[str]:
    return [f"{k}<{t}>" for k in KERNELS[file] for t in STORAGE.values()]


@dataclass(frozen=True)
class Resources:
    """What ptxas reports per kernel: the first numbers to read before any device time."""
    registers: int
    stack_bytes: int
    spill_bytes: int            # stores + loads
    shared_bytes: int


@dataclass(frozen=True)
class Cubin:
    file: str
    arch: str
    image: bytes
    log: str
    lowered: dict[str, str]     # name expression -> mangled symbol in the image
    resources: dict[str, Resources] = field(default_factory=dict)    # name expression -> ptxas report


_PROPS = re.compile(r"Function properties for (\S+)\s+ptxas\s+\.\s+(\d+) bytes stack frame, (\d+) bytes spill "
                    r"stores, (\d+) bytes spill loads\s+ptxas info\s+: Used (\d+) registers"
                    r"[^\n]*?(?:, (\d+) bytes smem)?\n")


def _resources(log: str, lowered: dict[str, str]) -> dict[str, Resources]:
    by_symbol = {m[1]: Resources(int(m[5]), int(m[2]), int(m[3]) + int(m[4]), int(m[6] or 0))
                 for m in _PROPS.finditer(log + "\n")}
    return {name: by_symbol[sym] for name, sym in lowered.items() if sym in by_symbol}


def _nvrtc_candidates() -> list[str]:
    """Where NVRTC may be: the nvidia-cuda-nvrtc-cu12 wheel (nvidia/cuda_nvrtc/lib), the CUDA 13
    wheels' layout (nvidia/cu13/lib, as CUDA 13 builds of torch and CuPy install it), then the
    loader's search path."""
    found = []
    try:
        import nvidia
        for root in map(Path, nvidia.__path__):
            found += [str(root / "cuda_nvrtc" / "lib" / "libnvrtc.so.12"), str(root / "cu13" / "lib" / "libnvrtc.so.13")]
    except ImportError:
        pass
    return [f for f in found if Path(f).is_file()] + ["libnvrtc.so", "libnvrtc.so.13", "libnvrtc.so.12"]


@functools.cache
def _nvrtc() -> ctypes.CDLL:
    tried = []
    for name in _nvrtc_candidates():
        try:
            return ctypes.CDLL(name)
        except OSError as e:
            tried.append(f"{name}: {e}")
    raise KernelBuildError("NVRTC not found (pip install nvidia-cuda-nvrtc-cu12, a test dependency); tried "
                           + "; ".join(tried))


def _check(lib: ctypes.CDLL, status: int, what: str) -> None:
    if status:
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        raise KernelBuildError(f"{what}: {lib.nvrtcGetErrorString(status).decode()}")


def compile_cubin(file: str, arch: str = "sm_90") -> Cubin:
    """Compile `file` for `arch` with NVRTC; raise KernelBuildError with the log on failure."""
    lib, prog = _nvrtc(), ctypes.c_void_p()
    text = source(file).encode()
    _check(lib, lib.nvrtcCreateProgram(ctypes.byref(prog), text, file.encode(), 0, None, None), "nvrtcCreateProgram")
    try:
        names = name_expressions(file)
        for n in names:
            _check(lib, lib.nvrtcAddNameExpression(prog, n.encode()), f"nvrtcAddNameExpression({n})")
        opts = [f"--gpu-architecture={arch}".encode(), *(o.encode() for o in _OPTIONS), b"--ptxas-options=-v"]
        status = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, log)
        log_text = log.value.decode(errors="replace")
        if status:
            raise KernelBuildError(f"{file} does not compile for {arch}:\n{log_text}")
        _check(lib, lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "nvrtcGetCUBINSize")
        image = ctypes.create_string_buffer(size.value)
        _check(lib, lib.nvrtcGetCUBIN(prog, image), "nvrtcGetCUBIN")
        lowered = {}
        for n in names:
            out = ctypes.c_char_p()
            _check(lib, lib.nvrtcGetLoweredName(prog, n.encode(), ctypes.byref(out)), f"nvrtcGetLoweredName({n})")
            lowered[n] = out.value.decode()
        return Cubin(file, arch, image.raw, log_text, lowered, _resources(log_text, lowered))
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


@functools.cache
def _module(file: str):
    import cupy
    return cupy.RawModule(code=source(file), options=_OPTIONS, name_expressions=name_expressions(file))


@functools.cache
def function(kernel: str, dtype_name: str):
    """The CuPy kernel `kernel<storage of dtype_name>` on the current device (compiled once)."""
    file = next((f for f, names in KERNELS.items() if kernel in names), None)
    if file is None or dtype_name not in STORAGE:
        raise KeyError(f"no kernel {kernel!r} for {dtype_name}")
    return _module(file).get_function(f"{kernel}<{STORAGE[dtype_name]}>")
