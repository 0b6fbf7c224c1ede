"""What the sharding analysis may do: the options its rules read."""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ShardOptions"]


@dataclass(frozen=True)
class ShardOptions:
    """vocab_parallel: split embeddings, LM heads and the loss over the vocabulary; gather_output:
    return full tensors where the model returns sharded ones (else each rank returns its own
    shard); sequence_parallel: between tensor-parallel regions, split the activations along the
    sequence (Korthikanti et al. 2022)."""

    vocab_parallel: bool = True
    gather_output: bool = True
    sequence_parallel: bool = False
