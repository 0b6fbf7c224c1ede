"""Hardware presets for the cost model: plain data, each number with its source.

Rates are per GPU. Link bandwidths are one direction (what a ring collective's step moves), so
NVLink's "600 GB/s" bidirectional datasheet figure is 300 here. The three efficiencies turn
datasheet peaks into rates real kernels reach; they are the only numbers not read off a
datasheet, and `benchmarks/RESULTS.md` shows how the predictions move with each.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

__all__ = ["Hardware", "PRESETS", "get_hardware", "preset_for_gpu"]


_ADAM_BYTES = 28    # per parameter per step: read fp16 grad, fp32 master, m, v; write them and fp16 weight


@dataclass(frozen=True)
class Hardware:
    name: str
    peak_tflops: float          # dense fp16/bf16 tensor-core rate, datasheet
    hbm_gb_s: float             # memory bandwidth, datasheet
    memory_gib: float           # usable device memory
    sms: int                    # streaming multiprocessors: the width of one GEMM wave
    gpus_per_node: int          # the tensor-parallel group stays inside a node
    nvlink_gb_s: float          # per GPU, one direction, inside a node
    network_gb_s: float         # per GPU, one direction, between nodes (NIC rate / GPUs per NIC)
    matmul_efficiency: float    # fraction of peak a large, well-shaped GEMM sustains in training
    memory_efficiency: float    # fraction of HBM bandwidth a streaming kernel reaches
    network_efficiency: float   # collective bus bandwidth / link rate
    latency_us: float = 10.0    # start-up cost of one collective or point-to-point message
    # How the runtime stores things on this hardware (GPUs: Megatron's mixed precision; the `cpu`
    # profile: fp32 everywhere, AdamW's state in fp32, dropout masks in the input's dtype).
    activation_bytes: int = 2           # per activation element
    mask_bytes: int = 1                 # per dropout-mask element
    weight_bytes: int = 2               # per parameter in the compute dtype (the optimizer's: memory_model.param_bytes)
    grad_bytes: int = 4                 # per gradient element held (Megatron's fp32 main_grad)
    reduce_bytes: int = 2               # per gradient element on the wire (fp16, as the PTD-P runs reduced)
    tile: tuple[int, int] = (256, 128)  # GEMM output tile (one per SM at a time); (1, 1): no padding
    layer_overhead_s: float = 0.0       # fixed cost of one layer's forward + backward (op dispatch)
    step_overhead_s: float = 0.0        # fixed cost of a step outside the layers
    cores: int = 0                      # CPU cores shared by the ranks (0: one device per rank)
    gemm_traffic: bool = True           # a GEMM takes at least its operands' bytes at hbm_gb_s
    optimizer_s_per_param: float = 0.0  # measured optimizer step (0: 28 bytes per parameter at hbm_gb_s)
    optimizer_s_per_tensor: float = 0.0  # and its fixed cost per parameter tensor (GPT: 12 per layer)
    op_overhead_s: float = 0.0          # per aten op, forward or backward (planning/graph_time.py; 0: none)
    op_bytes_gb_s: float = 0.0          # what non-matmul aten ops move per second (0: hbm_gb_s's rate)
    attention_tflops: float = 0.0       # a fused attention kernel's (SDPA's) rate as measured (0: the GEMM rate)
    # Start-up cost of each collective of two ranks where measured (the `cpu` profile: gloo's
    # reduce-scatter costs about an all-reduce, its all-gather and a send about half): ((kind, us), ...)
    # for "all_reduce", "reduce_scatter", "all_gather" and "send"; a kind not listed: startup_seconds' rule.
    startup_us: tuple[tuple[str, float], ...] = ()
    # A zero-bubble schedule's B + W over one whole backward (runtime/backward_split.py): what the
    # split costs the schedule choice (planning/schedule_choice.py). Measured only on CPUs so far
    # (benchmarks/RESULTS.md: 1.04-1.05 per stage on an HF Llama of hidden 512, one core a rank);
    # the presets take the 1.05 the split is built to stay under.
    split_backward: float = 1.05
    # Dense FP8 tensor-core rate, datasheet (0: no FP8 tensor cores; precision="fp8" refused there)
    fp8_tflops: float = 0.0

    def __post_init__(self):
        for name in ("peak_tflops", "hbm_gb_s", "memory_gib", "nvlink_gb_s", "network_gb_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"hardware {self.name!r}: {name} must be positive, got {getattr(self, name)}")
        if self.split_backward < 1:
            raise ValueError(f"hardware {self.name!r}: split_backward (B + W over one backward) must be at least 1, "
                             f"got {self.split_backward}")
        for name in ("matmul_efficiency", "memory_efficiency", "network_efficiency"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"hardware {self.name!r}: {name} must be in (0, 1], got {getattr(self, name)}")

    def startup_seconds(self, kind: str) -> float:
        """Start-up cost of one collective of `kind` between two ranks: as measured (`startup_us`),
        else `latency_us` for an all-reduce and half of it for the rest (a two-rank all-reduce is
        two message steps, a reduce-scatter's and an all-gather's)."""
        measured = dict(self.startup_us)
        if kind in measured:
            return measured[kind] * 1e-6
        return self.latency_us * 1e-6 * (1.0 if kind == "all_reduce" else 0.5)

    def optimizer_seconds(self, params: float, tensors: int) -> float:
        """AdamW's step over `params` elements in `tensors` tensors: as measured (the `cpu` profile),
        else its bytes at the memory rate (_ADAM_BYTES a parameter)."""
        if self.optimizer_s_per_param:
            return params * self.optimizer_s_per_param + tensors * self.optimizer_s_per_tensor
        return _ADAM_BYTES * params / (self.hbm_gb_s * 1e9 * self.memory_efficiency)


# Efficiencies. memory 0.9: a device-to-device copy on an H200 here moved 4.3 of the datasheet's
# 4.8 TB/s (device/KINDS.md). network 0.8: NCCL's ring reaches about 80% of link rate on large
# messages. matmul 0.70 (A100, V100): the one constant chosen against the Megatron tables (a
# global value, the same for every row); an isolated 8192^3 bf16 product on an H200 here ran at
# 0.78-0.81 of peak on random data, and sustained training (clocks held down by power, GEMMs of
# 2048 rows) sits below that. H100/H200 use the measured 0.79 less the same training margin.
_EFF = dict(memory_efficiency=0.9, network_efficiency=0.8)

PRESETS: dict[str, Hardware] = {
    # DGX A100 80GB, the PTD-P paper's cluster: 8 GPUs per node on NVLink 3 (600 GB/s both ways),
    # 8 InfiniBand HDR links per node (200 Gb/s = 25 GB/s each, one per GPU).
    "a100-80gb": Hardware("a100-80gb", peak_tflops=312, hbm_gb_s=2039, memory_gib=80, sms=108,
                          gpus_per_node=8, nvlink_gb_s=300, network_gb_s=25, matmul_efficiency=0.70, **_EFF),
    # DGX H100: NVLink 4 (900 GB/s both ways), 8 InfiniBand NDR links per node (400 Gb/s each).
    "h100-80gb": Hardware("h100-80gb", peak_tflops=989, hbm_gb_s=3350, memory_gib=80, sms=132,
                          gpus_per_node=8, nvlink_gb_s=450, network_gb_s=50, matmul_efficiency=0.70,
                          fp8_tflops=1979, **_EFF),           # FP8: twice bf16's dense rate
    # HGX H200: the H100's compute and links with 141 GB of HBM3e at 4.8 TB/s.
    "h200": Hardware("h200", peak_tflops=989, hbm_gb_s=4800, memory_gib=141, sms=132,
                     gpus_per_node=8, nvlink_gb_s=450, network_gb_s=50, matmul_efficiency=0.70,
                     fp8_tflops=1979, **_EFF),
    # DGX B200: NVLink 5 (1.8 TB/s both ways), 8 ConnectX-7 links per node (400 Gb/s each), 180 GB
    # of HBM3e at 8 TB/s; 2.25 PFLOP/s dense bf16 (4.5 fp8). Unmeasured here: the H100's efficiencies.
    "b200": Hardware("b200", peak_tflops=2250, hbm_gb_s=8000, memory_gib=180, sms=148,
                     gpus_per_node=8, nvlink_gb_s=900, network_gb_s=50, matmul_efficiency=0.70,
                     fp8_tflops=4500, **_EFF),
    # DGX-2H V100 32GB, the 2019 Megatron paper's cluster: 16 GPUs per node on NVSwitch (300 GB/s
    # both ways), 8 InfiniBand adapters giving 100 GB/s per node between servers.
    "v100-32gb": Hardware("v100-32gb", peak_tflops=125, hbm_gb_s=900, memory_gib=32, sms=80,
                          gpus_per_node=16, nvlink_gb_s=150, network_gb_s=100 / 16, matmul_efficiency=0.70, **_EFF),
}


def get_hardware(hardware: str | Hardware, **overrides) -> Hardware:
    """A preset by name (or a Hardware as is), with fields replaced by `overrides`."""
    if isinstance(hardware, Hardware):
        hw = hardware
    elif hardware in PRESETS:
        hw = PRESETS[hardware]
    else:
        raise ValueError(f"unknown hardware {hardware!r}; presets: {', '.join(sorted(PRESETS))} "
                         "(or pass an autoshard.planning.hardware.Hardware)")
    return replace(hw, **overrides) if overrides else hw


def preset_for_gpu(name: str, memory_gib: float) -> str | None:
    """The preset describing a GPU by its device name ("NVIDIA H100 80GB HBM3") and memory, or None:
    the preset's model must appear in the name and its memory be within 15% of the device's (an
    A100 with 40 GiB is not the a100-80gb preset)."""
    for key, hw in PRESETS.items():
        model = key.split("-")[0]
        if model in name.lower() and abs(hw.memory_gib - memory_gib) <= 0.15 * hw.memory_gib:
            return key
    return None
