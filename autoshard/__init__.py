"""autoshard: Megatron-style tensor parallelism as a compiler pass over torch.export graphs."""
from .api import autoshard
from .errors import AutoshardError, CaptureError, ShardingError
from .program import ShardedProgram
from .rank import RankProgram

__all__ = ["autoshard", "ShardedProgram", "RankProgram", "AutoshardError", "CaptureError", "ShardingError"]
__version__ = "0.1.0"
