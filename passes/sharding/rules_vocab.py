"""Rules for the vocabulary: the input embedding, the loss, and what the model returns.

With vocabulary parallelism (Megatron's VocabParallelEmbedding), an embedding table is split by
rows: each rank looks up the ids it owns, zeroes the rest, and g sums the partial embeddings. An LM
head whose weight is that table (tied) or any column-parallel head produces vocab-sharded logits,
which a cross-entropy consumes without gathering them. Vocabularies that tp does not divide are
padded to the next multiple; padded rows are never looked up, and padded logits are masked.
"""
from __future__ import annotations

import torch.fx as fx

from autoshard.errors import ShardingError
from autoshard.passes.graph_reading import op_name
from autoshard.passes.sharding.index_sets import even_layout, is_partition, padded_even_layout
from autoshard.passes.sharding.placement import (
    REPLICATE,
    Abandon,
    GatherOutputs,
    NodeSharding,
    ParamUse,
    SequenceScatter,
    Shard,
    VocabCrossEntropy,
    VocabLookup,
)
from autoshard.passes.sharding.rule_context import RuleContext
from autoshard.passes.sharding.rules_compute import default

__all__ = ["VOCAB_RULES", "output"]


def _starts_valid(layout, vocab: int):
    starts = tuple(rs[0][0] for rs in layout)
    counts = tuple(rs[0][1] - rs[0][0] for rs in layout)
    valid = tuple(max(0, min(c, vocab - s)) for s, c in zip(starts, counts))
    return starts, counts, valid


_ID_PATH = ("view", "reshape", "_unsafe_view", "to", "_to_copy", "contiguous", "clone", "alias", "detach")


def _token_ids(ids: object) -> bool:
    """Ids that are the model's first input (token ids: `input_ids`, nanoGPT's `idx`), not computed
    (positions) nor another input (`position_ids`, `token_type_ids`): those tables stay whole
    whether or not a call passes them, so every call shards the same parameters."""
    while isinstance(ids, fx.Node) and ids.op == "call_function" and op_name(ids.target) in _ID_PATH:
        ids = ids.args[0]
    if not (isinstance(ids, fx.Node) and ids.op == "placeholder"):
        return False
    return ids is next(n for n in ids.graph.nodes if n.op == "placeholder")


def embedding(ctx: RuleContext, node: fx.Node) -> NodeSharding:
    """Megatron splits the word embedding only: small tables (positions, token types) stay whole."""
    table, ids = node.args[0], node.args[1]
    prm = ctx.param(table)
    if not ctx.options.vocab_parallel or prm is None or prm[1] or ctx.is_pinned(node) \
            or isinstance(ctx.place(ids), Shard) or not _token_ids(ids):
        return default(ctx, node)
    vocab = int(ctx.shape(table)[0])
    layout, padded = padded_even_layout(vocab, ctx.tp)
    starts, _, valid = _starts_valid(layout, vocab)
    res = NodeSharding(REPLICATE, role="vocab", edits=[VocabLookup(starts, valid)])
    res.params.append(ParamUse(prm[0], 0, layout, padded if padded != vocab else None))
    if ctx.options.sequence_parallel:
        out_shape = ctx.shape(node)
        if len(out_shape) != 3 or not out_shape[1].is_Integer:
            raise ShardingError(f"sequence parallelism needs token embeddings of shape (batch, sequence, "
                                f"hidden); {ctx.where(node)} gives {out_shape}")
        seq = int(out_shape[1])
        if seq % ctx.tp:
            raise ShardingError(f"sequence parallelism: sequence length {seq} is not divisible by "
                                f"tp={ctx.tp} (at {ctx.where(node)})")
        seq_layout = even_layout(seq, ctx.tp)
        res.placement = Shard(1, seq, seq_layout, frozenset([node.name]))
        res.edits.append(SequenceScatter(1))
    return res


def cross_entropy(ctx: RuleContext, node: fx.Node) -> NodeSharding:
    logits = node.args[0]
    p = ctx.place(logits)
    if not isinstance(p, Shard):
        return default(ctx, node)
    weight = node.args[2] if len(node.args) > 2 else node.kwargs.get("weight")
    smoothing = node.args[5] if len(node.args) > 5 else node.kwargs.get("label_smoothing", 0.0)
    if len(ctx.shape(logits)) != 2 or p.dim != 1 or weight is not None or smoothing or \
            not is_partition(p.layout, p.size) or any(len(rs) != 1 for rs in p.layout):
        raise Abandon(p.roots, f"{ctx.where(node)}: cross-entropy form not supported on vocab shards")
    starts, counts, valid = _starts_valid(p.layout, int(ctx.shape(logits)[1]))
    return NodeSharding(REPLICATE, role="row", edits=[VocabCrossEntropy(starts, counts, valid)])


def output(ctx: RuleContext, node: fx.Node) -> NodeSharding:
    for a in node.all_input_nodes:
        p = ctx.place(a)
        if isinstance(p, Shard) and not (ctx.options.vocab_parallel and is_partition(p.layout, p.size)):
            raise Abandon(p.roots, f"{ctx.where(a)} is returned from the model while sharded")
    return NodeSharding(edits=[GatherOutputs(ctx.options.gather_output)])


VOCAB_RULES = {"embedding": embedding, "cross_entropy_loss": cross_entropy}
