"""autoshard: Megatron-style tensor and pipeline parallelism as compiler passes over torch.export graphs."""
from .api import autoshard
from .costmodel import estimate
from .errors import AutoshardError, CaptureError, ShardingError
from .pipeline import PipelineRuntime
from .planner import ModelShape, plan
from .program import ShardedProgram
from .rank import RankProgram

__all__ = ["autoshard", "plan", "estimate", "ModelShape", "ShardedProgram", "RankProgram", "PipelineRuntime", "AutoshardError", "CaptureError", "ShardingError"]
__version__ = "0.1.0"
