"""Where `autoshard train` runs each rank, and the defaults that follow: on GPUs each process takes
the GPU of its local rank, NCCL carries the collectives, the model computes in bf16 (fp32 main
weights in the optimizer); on the CPU, gloo, fp32. The fused ops are off by default everywhere
(`--fuse` turns them on): measured on an H200, a 406M Llama's step took 1.50x as long with them
(benchmarks/RESULTS.md, "The first GPU session").

    place = placement(opts, os.environ, cuda_devices=torch.cuda.device_count())

A pure function of the options, the launcher's environment and the GPU count, so every choice is
tested on a machine without a GPU."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from autoshard.planning.hardware import preset_for_gpu
from autoshard.train.options import TrainError, TrainOptions

__all__ = ["Placement", "placement", "move_runtime", "running_hardware"]


@dataclass(frozen=True)
class Placement:
    device: str                 # "cpu" or "cuda:<local rank>"
    backend: str                # the process group's: "gloo" or "nccl"
    precision: str              # "fp32", "bf16", "fp16" or "fp8" (its linears; bf16 elsewhere)
    fuse: bool

    @property
    def is_cuda(self) -> bool:
        return self.device.startswith("cuda")


def placement(opts: TrainOptions, env: Mapping[str, str], cuda_devices: int) -> Placement:
    """The device, backend, precision and fusion of this rank. --device auto takes the GPUs when
    there are any; --precision and --fuse, when given, are kept as given."""
    want = opts.device
    if want == "auto":
        want = "cuda" if cuda_devices > 0 else "cpu"
    if want == "cpu":
        return Placement("cpu", "gloo", opts.precision or "fp32", opts.fuse)
    local_rank, local_world = int(env.get("LOCAL_RANK", "0")), int(env.get("LOCAL_WORLD_SIZE", "1"))
    if cuda_devices == 0:
        raise TrainError("--device cuda: no CUDA GPU is visible here (torch.cuda.device_count() is 0)")
    if local_world > cuda_devices:
        raise TrainError(f"{local_world} processes on this node but {cuda_devices} GPU(s) visible: each rank "
                         f"needs a GPU of its own (--nproc-per-node {cuda_devices} or fewer, or --device cpu)")
    if opts.precision == "fp8":
        major, minor = torch.cuda.get_device_capability(local_rank)
        if (major, minor) < (8, 9):
            raise TrainError(f"--precision fp8: {torch.cuda.get_device_name(local_rank)} (compute capability "
                             f"{major}.{minor}) has no FP8 tensor cores (Ada 8.9 and Hopper 9.0 do); use bf16 here, or "
                             f"--device cpu to check an FP8 run slowly")
    return Placement(f"cuda:{local_rank}", "nccl", opts.precision or "bf16", opts.fuse)


def move_runtime(rt: nn.Module, device: str) -> None:
    """A runtime built on the CPU (materialized or loaded from a folder) moved to `device`: every
    parameter and buffer, and the devices its graphs name (arange, zeros, ...)."""
    from autoshard.passes.rewrite.retarget import retarget_device
    values: dict[str, torch.Tensor] = {}
    for name, t in list(rt.named_parameters()) + list(rt.named_buffers()):
        moved = t.detach().to(device)
        values[name] = nn.Parameter(moved, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else moved
    rt.set_tensors(values)
    for gm in rt.graph_modules():
        retarget_device(gm, device, source="cpu")


def running_hardware(place: Placement) -> str | None:
    """The cost model's preset for the device this rank runs on: its GPU's, when a preset describes
    it; None on the CPU (the presets are GPUs) or on a GPU no preset describes."""
    if not place.is_cuda:
        return None
    props = torch.cuda.get_device_properties(torch.device(place.device))
    return preset_for_gpu(props.name, props.total_memory / 2 ** 30)
