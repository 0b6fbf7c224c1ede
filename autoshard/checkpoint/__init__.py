"""Checkpoint: sharded safetensors checkpoints (each rank writes its own shards), their index, consolidation and materialization."""
from autoshard.checkpoint.sharded import complete, latest, layout_of, load, save, save_ranks

__all__ = ["save", "save_ranks", "load", "latest", "complete", "layout_of"]
