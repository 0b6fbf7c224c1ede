"""What the sharding analysis writes on a node: its placement, and the edits the rewrite will make.

Placements follow the paper's vocabulary: a value is replicated on every tensor-parallel rank, or
sharded along one dim with a per-rank layout. Partial sums never outlive the row-parallel matmul
that makes them: the rewrite reduces them at once (Megatron's g), before the bias is added.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from autoshard.passes.sharding.index_sets import Layout

__all__ = [
    "Replicate", "Shard", "Placement", "Origin", "REPLICATE", "Abandon", "Fallback", "Demand",
    "NodeSharding", "ParamUse", "ColumnInput", "RowParallel", "ArgEdit", "Restrict", "VocabLookup",
    "VocabCrossEntropy", "GatherOutputs", "SequenceScatter", "GatherTokens", "PartialStatistic", "ReadSplit",
]


@dataclass(frozen=True)
class Replicate:
    def __repr__(self) -> str:
        return "R"


REPLICATE = Replicate()


@dataclass(frozen=True)
class Origin:
    """Index i of this value's sharded dim covers root indices [offset + i*scale, offset + (i+1)*scale)."""

    root: str
    offset: int
    scale: int


@dataclass(frozen=True)
class Shard:
    dim: int
    size: int                     # global size of the sharded dim
    layout: Layout
    roots: frozenset[str]         # the column-parallel matmuls whose region this value belongs to
    origin: Origin | None = None  # how to send a layout demand back to the root, when invertible

    def __repr__(self) -> str:
        return f"S({self.dim})"


Placement = Replicate | Shard


class Abandon(Exception):
    """The region of `roots` meets something the table cannot shard: those weights stay replicated.
    `by_design`: they stay whole because Megatron keeps them whole too (a router, a low-rank
    down-projection), not for want of a rule; the report says so."""

    def __init__(self, roots: frozenset[str], reason: str, *, by_design: bool = False):
        super().__init__(reason)
        self.roots, self.reason, self.by_design = roots, reason, by_design


@dataclass(frozen=True)
class Fallback:
    """A region left replicated (the record of an Abandon the analysis accepted), and why."""

    roots: tuple[str, ...]          # node names of the column-parallel matmuls left replicated
    modules: tuple[str, ...]        # their module paths
    reason: str
    by_design: bool = False         # whole as in Megatron (routers, MLA's down-projections)


class Demand(Exception):
    """A consumer needs the root's layout cut at `cuts` and/or in blocks of `granularity` over
    [lo, hi), or (`unpad`) not padded past its real size."""

    def __init__(self, root: str, reason: str, *, cuts: tuple[int, ...] = (),
                 granularity: tuple[int, int, int] | None = None, unpad: bool = False):
        super().__init__(reason)
        self.root, self.reason, self.cuts, self.granularity, self.unpad = root, reason, cuts, granularity, unpad


class ReadSplit(Exception):
    """A replicated operand gathers rows of a parameter by index (an expert's bias by expert id,
    `B[ids]`) and is read only here, cut to `layout` along its dim `param_dim` of the parameter: the
    analysis revisits that gather (node `node`) reading the parameter split instead."""

    def __init__(self, node: str, param_dim: int, layout: Layout, roots: frozenset[str]):
        super().__init__(f"read {node} split on dim {param_dim}")
        self.node, self.param_dim, self.layout, self.roots = node, param_dim, layout, roots


@dataclass(frozen=True)
class ParamUse:
    """Parameter `name` is read at this node sharded along `dim` (None: whole) with `layout`.

    `padded` is the size the layout covers when it exceeds the parameter (a vocabulary that tp
    does not divide): rows past the parameter's own size are zeros on the ranks that hold them.
    """

    name: str
    dim: int | None = None
    layout: Layout | None = None
    padded: int | None = None


@dataclass(frozen=True)
class ColumnInput:
    """Argument `arg` is the replicated input of a column-parallel matmul: route it through f."""

    arg: int


@dataclass(frozen=True)
class RowParallel:
    """This matmul contracts a sharded dim: drop the bias argument `bias_arg`, apply g, add the bias."""

    bias_arg: int | None
    bias_kwarg: str | None = None
    scatter: tuple[int, int] | None = None    # sequence parallel: reduce-scatter along (dim, tiles)


@dataclass(frozen=True)
class PartialStatistic:
    """A mean or sum over the sharded feature dim (a norm over all heads' features): each rank's
    statistic of its own features goes through g (summed over the ranks), times `scale` (1/tp for
    a mean of equal local shares). The result is replicated; where it meets sharded values again it
    enters through f, so its gradient, partial on each rank, is summed too."""

    scale: float


@dataclass(frozen=True)
class ArgEdit:
    """Replace a literal: positional `arg`, or the keyword argument named `arg` (and `item` inside a
    list argument), gets per-rank values."""

    arg: int | str
    values: tuple[object, ...]     # one per rank
    item: int | None = None


@dataclass(frozen=True)
class Restrict:
    """Argument `arg` (`item` in a list) holds more of `dim` than this node needs: keep `keep[r]`."""

    arg: int
    dim: int
    keep: tuple[tuple[tuple[int, int], ...], ...]
    item: int | None = None


@dataclass(frozen=True)
class VocabLookup:
    """Embedding on vocab-sharded rows: look up local ids, zero the others, then g.

    Per rank: `starts[r]` is its first row, `valid[r]` how many of its rows are real (not padding)."""

    starts: tuple[int, ...]
    valid: tuple[int, ...]


@dataclass(frozen=True)
class SequenceScatter:
    """Sequence parallelism starts here: the partial embeddings are reduce-scattered along `dim`
    (each rank keeps its tokens of the sum) instead of all-reduced."""

    dim: int
    outer: int = 1


@dataclass(frozen=True)
class GatherTokens:
    """Argument `arg` is sequence-sharded along `dim` (in `outer` tiles): all-gather it before this
    column-parallel matmul; the backward reduce-scatter sums what f would have."""

    arg: int
    dim: int
    outer: int
    reduce_grads: bool = True     # False: the consumer is replicated (each rank keeps its grad chunk)


@dataclass(frozen=True)
class VocabCrossEntropy:
    """Cross-entropy of vocab-sharded logits (argument 0) against replicated targets (argument 1)."""

    starts: tuple[int, ...]
    counts: tuple[int, ...]
    valid: tuple[int, ...]


@dataclass(frozen=True)
class GatherOutputs:
    """The output node: gather every sharded value it returns (or return local shards)."""

    gather: bool


@dataclass
class NodeSharding:
    placement: Placement | tuple[Placement, ...] = REPLICATE
    params: list[ParamUse] = field(default_factory=list)
    edits: list[ColumnInput | RowParallel | ArgEdit | Restrict | VocabLookup | VocabCrossEntropy
                | GatherOutputs | SequenceScatter | GatherTokens | PartialStatistic] = field(default_factory=list)
    role: str | None = None        # "column" / "row" for the printed table
    region: frozenset[str] = frozenset()   # roots of the regions this node touches (set by the driver)
