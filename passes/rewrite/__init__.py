"""The rank rewrite: an annotated graph -> rank r's graph with its collectives.

This was the module `autoshard.passes.rewrite`; its names, now in rank_rewrite.py and
autoshard/parallel/, are served from here with a DeprecationWarning for one release."""
from autoshard._deprecated import moved_names

__getattr__ = moved_names(__name__, {
    "rewrite_rank": "autoshard.passes.rewrite.rank_rewrite", "RankGraph": "autoshard.passes.rewrite.rank_rewrite",
    "grad_flow": "autoshard.passes.rewrite.grad_flow", "SyncSpec": "autoshard.parallel.tensor_parallel",
    "SequenceSpec": "autoshard.parallel.sequence_parallel", "GatherSpec": "autoshard.parallel.vocab_parallel",
    "CrossEntropySpec": "autoshard.parallel.vocab_parallel", "RandomOpSpec": "autoshard.parallel.rng",
})
