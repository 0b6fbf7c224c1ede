"""autoshard: Megatron-style tensor and pipeline parallelism as compiler passes over torch.export graphs.

The layout (docs/ARCHITECTURE.md tells the data flow):
  api.py        autoshard(): the compile as a straight line of passes
  compile/      capture, the compiler's passes per signature and rank, ShardedProgram, RankProgram, simulator
  parallel/     the collectives: autograd functions, modules, simulated forms, the specs the rewrite emits
  runtime/      one process of a job: mesh, executor, schedules, p2p, gradients, distributed optimizer, traces
  planning/     cost model, formulas, GEMM timing, hardware, planner
  checkpoint/   sharded safetensors checkpoints, consolidation, materialization
  passes/       (installed as autoshard.passes) sharding analysis, rank rewrite, stages, fusion
  kernels/      (installed as autoshard.kernels) fused ops: CUDA sources and exact torch references
"""
from autoshard.api import autoshard
from autoshard.compile.program import ShardedProgram
from autoshard.compile.rank import RankProgram
from autoshard.errors import AutoshardError, CaptureError, ShardingError
from autoshard.planning.costmodel import estimate
from autoshard.planning.planner import ModelShape, plan
from autoshard.runtime.distributed_optimizer import DistributedOptimizer
from autoshard.runtime.executor import MeshRuntime
from autoshard.verify import Certificate, verify_model

__all__ = ["autoshard", "plan", "estimate", "ModelShape", "ShardedProgram", "RankProgram", "MeshRuntime", "DistributedOptimizer",
           "Certificate", "verify_model",
           "AutoshardError", "CaptureError", "ShardingError"]
__version__ = "0.1.0"
