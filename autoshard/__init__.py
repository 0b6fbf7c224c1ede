"""autoshard: Megatron-style tensor and pipeline parallelism as compiler passes over torch.export graphs."""
from .api import autoshard
from .errors import AutoshardError, CaptureError, ShardingError
from .pipeline import PipelineRuntime
from .program import ShardedProgram
from .rank import RankProgram

__all__ = ["autoshard", "ShardedProgram", "RankProgram", "PipelineRuntime", "AutoshardError", "CaptureError", "ShardingError"]
__version__ = "0.1.0"
