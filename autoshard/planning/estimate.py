"""The cost model's answer for one configuration: `Estimate` (time, throughput, memory, by cause)."""
from __future__ import annotations

from dataclasses import dataclass, field

from autoshard.planning.memory_model import RankMemory
from autoshard.planning.moe_cost import MoEShape

__all__ = ["Estimate", "RESERVED"]

RESERVED = 0.1     # device memory kept back for the CUDA context, NCCL buffers and fragmentation


@dataclass(frozen=True)
class Estimate:
    hidden: int
    layers: int
    heads: int
    vocab: int
    seq: int
    tp: int
    pp: int
    dp: int
    global_batch: int
    microbatch: int
    virtual: int                    # pipeline chunks per rank (the paper's v)
    hardware: str
    recompute: str
    sequence_parallel: bool
    seconds_per_iteration: float
    tflops_per_gpu: float           # FLOPs counted as the paper does, recomputation included
    model_tflops_per_gpu: float     # FLOPs of the model alone (no recomputation): model FLOP utilization
    memory_gib_per_gpu: float
    fits: bool
    peak_tflops: float
    breakdown: dict[str, float] = field(default_factory=dict)   # seconds per iteration, by cause
    memory: RankMemory | None = None    # the busiest rank's peak, by cause
    busiest_pp_rank: int = 0            # the pipeline rank holding the most
    memory_gib_total: float = 0.0       # the hardware's memory per device
    ep: int = 1                         # expert-parallel ranks (inside dp) of a mixture-of-experts model
    moe: MoEShape | None = None
    cp: int = 1                         # context-parallel ranks (each holds seq / cp tokens)
    schedule: str = "1f1b"              # the pipeline schedule (runtime/schedules.py)
    schedules_weighed: tuple[str, ...] = ()     # the schedules the planner compared, at this microbatch
    distributed_optimizer: bool = False     # AdamW's state and main weights divided over dp x cp
    zero: int = 1                       # 2: gradients divided too; 3: parameters too (fully sharded)

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    @property
    def microbatches(self) -> int:
        return self.global_batch // (self.dp * self.microbatch)

    @property
    def percent_of_peak(self) -> float:
        return 100 * self.tflops_per_gpu / self.peak_tflops

    def explain(self) -> str:
        parts = ", ".join(f"{k} {100 * x / self.seconds_per_iteration:.0f}%"
                          for k, x in self.breakdown.items() if x > 0)
        split = f"tp={self.tp} pp={self.pp} dp={self.dp}" + f" ep={self.ep}" * (self.ep > 1) + \
            f" cp={self.cp}" * (self.cp > 1) + " sp" * self.sequence_parallel + \
            (f" zero={self.zero}" if self.zero > 1 else " distributed-optimizer" * self.distributed_optimizer)
        schedule = f" schedule={self.schedule}" if self.pp > 1 else ""
        return (f"{split} microbatch={self.microbatch} virtual={self.virtual}{schedule}: "
                f"{self.tflops_per_gpu:.0f} TFLOP/s per GPU ({self.percent_of_peak:.0f}% of peak), "
                f"{self.seconds_per_iteration:.2f} s/iteration, {self.memory_gib_per_gpu:.1f} GiB per GPU"
                f"{'' if self.fits else ' (does NOT fit)'}; time: {parts}"
                + (f"; memory (pipeline rank {self.busiest_pp_rank}, recompute={self.recompute}): "
                   f"{self.memory.explain()}, {'within' if self.fits else 'over'} "
                   f"{(1 - RESERVED) * self.memory_gib_total:.1f} GiB usable" if self.memory else "")
                + (f"; {self.schedule}: the fastest of the schedules that fit ({'; '.join(self.schedules_weighed)})"
                   if self.schedules_weighed else ""))
