"""Per-rank index sets over one tensor dimension.

A sharded dimension of global size S is described by a *layout*: for every tensor-parallel rank,
the sorted, disjoint ranges of global indices that rank holds. Megatron's plain split, its strided
split of fused QKV weights, and the grouped-query case where several ranks share one kv head are all
layouts, so a single algebra moves them through views, splits and head reshapes.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "Ranges", "Layout", "Segment", "cut_segments", "even_layout", "padded_even_layout", "layout_from_segments", "expand", "compress", "tile",
    "token_tiles", "untile",
    "joined", "window", "positions_within", "copies", "is_partition", "is_even_chunks", "is_whole_everywhere", "local_size", "LayoutError",
]

Ranges = tuple[tuple[int, int], ...]   # sorted, disjoint, merged [start, stop) ranges
Layout = tuple[Ranges, ...]            # one Ranges per rank


class LayoutError(ValueError):
    """A layout cannot be built with the numbers asked for (the message says which)."""


@dataclass(frozen=True)
class Segment:
    """A stretch [start, start+size) of a root's output dimension, split in blocks of `granularity`."""

    start: int
    size: int
    granularity: int = 1


def cut_segments(segs: list[Segment], cuts: list[int]) -> list[Segment]:
    """The segments cut at every position of `cuts` that falls strictly inside one."""
    out: list[Segment] = []
    for s in segs:
        inner = sorted(c for c in set(cuts) if s.start < c < s.start + s.size)
        bounds = [s.start, *inner, s.start + s.size]
        out += [Segment(a, b - a, s.granularity) for a, b in zip(bounds, bounds[1:])]
    return out


def _merge(ranges: list[tuple[int, int]]) -> Ranges:
    out: list[tuple[int, int]] = []
    for a, b in sorted(r for r in ranges if r[1] > r[0]):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return tuple(out)


def even_layout(size: int, tp: int) -> Layout:
    if size % tp:
        raise LayoutError(f"size {size} is not divisible by tp={tp}")
    step = size // tp
    return tuple(((r * step, (r + 1) * step),) for r in range(tp))


def padded_even_layout(size: int, tp: int) -> tuple[Layout, int]:
    """An even split of `size` rounded up to a multiple of tp (a vocabulary), and that padded size."""
    padded = -(-size // tp) * tp
    return even_layout(padded, tp), padded


def layout_from_segments(segments: list[Segment], tp: int) -> Layout:
    """Each segment is cut into blocks of `granularity`; blocks are dealt to ranks in order.

    With nblocks divisible by tp every rank gets nblocks/tp consecutive blocks (Megatron's split);
    with tp divisible by nblocks, tp/nblocks consecutive ranks share one block (kv heads < tp).
    """
    per_rank: list[list[tuple[int, int]]] = [[] for _ in range(tp)]
    for seg in segments:
        if seg.size % seg.granularity:
            raise LayoutError(f"segment of {seg.size} is not a whole number of blocks of {seg.granularity}")
        nblocks = seg.size // seg.granularity
        g = seg.granularity
        if nblocks % tp == 0:
            step = nblocks // tp
            for r in range(tp):
                per_rank[r].append((seg.start + r * step * g, seg.start + (r + 1) * step * g))
        elif tp % nblocks == 0:
            for r in range(tp):
                b = r * nblocks // tp
                per_rank[r].append((seg.start + b * g, seg.start + (b + 1) * g))
        else:
            raise LayoutError(f"tp={tp} does not divide {nblocks} blocks of {g} "
                              f"(and {nblocks} blocks cannot be shared evenly by {tp} ranks)")
    return tuple(_merge(rs) for rs in per_rank)


def expand(layout: Layout, inner: int) -> Layout:
    """Index i of a dim becomes indices [i*inner, (i+1)*inner) of a flattened (dim, inner) pair."""
    return tuple(tuple((a * inner, b * inner) for a, b in rs) for rs in layout)


def tile(layout: Layout, count: int, stride: int) -> Layout:
    """The layout repeated `count` times, `stride` apart: a sharded dim merged behind outer dims."""
    if count == 1:
        return layout
    return tuple(_merge([(o * stride + a, o * stride + b) for o in range(count) for a, b in rs]) for rs in layout)


def token_tiles(layout: Layout, size: int, tp: int) -> int | None:
    """`outer` when the layout is `outer` equal tiles of the dim, each split evenly over the ranks in
    rank order (tokens of a [B*T] flattened batch: outer=B; of a plain T: outer=1); else None."""
    outer = len(layout[0])
    if size % outer or (size // outer) % tp:
        return None
    try:
        return outer if tile(even_layout(size // outer, tp), outer, size // outer) == layout else None
    except LayoutError:
        return None


def untile(layout: Layout, count: int, stride: int) -> Layout | None:
    """Inverse of tile: the per-tile layout, if the layout repeats it `count` times `stride` apart."""
    first = tuple(tuple((a, b) for a, b in rs if b <= stride) for rs in layout)
    return first if tile(first, count, stride) == layout else None


def compress(layout: Layout, inner: int) -> Layout | None:
    """Inverse of expand; None when some range is not made of whole blocks of `inner`."""
    out = []
    for rs in layout:
        if any(a % inner or b % inner for a, b in rs):
            return None
        out.append(tuple((a // inner, b // inner) for a, b in rs))
    return tuple(out)


def joined(layouts: list[Layout], sizes: list[int]) -> Layout:
    """The layout of a cat of dims laid out as `layouts` (of `sizes`): each rank's indices of piece i
    shifted by the sizes before it (the inverse of `window` over consecutive pieces)."""
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    return tuple(_merge([(o + a, o + b) for lay, o in zip(layouts, offsets) for a, b in lay[r]])
                 for r in range(len(layouts[0])))


def window(layout: Layout, lo: int, hi: int) -> Layout:
    """The part of each rank's set inside [lo, hi), shifted to start at 0 (a slice of the dim)."""
    return tuple(_merge([(max(a, lo) - lo, min(b, hi) - lo) for a, b in rs]) for rs in layout)


def positions_within(held: Ranges, needed: Ranges) -> Ranges | None:
    """Local positions (in `held` order) of the `needed` indices; None if not all are held."""
    out: list[tuple[int, int]] = []
    for na, nb in needed:
        offset = 0
        for ha, hb in held:
            if ha <= na and nb <= hb:
                out.append((offset + na - ha, offset + nb - ha))
                break
            offset += hb - ha
        else:
            return None
    return _merge(out)


def local_size(layout: Layout) -> int | None:
    """The number of indices each rank holds, or None when ranks hold different counts."""
    sizes = {sum(b - a for a, b in rs) for rs in layout}
    return sizes.pop() if len(sizes) == 1 else None


def copies(layout: Layout, size: int) -> int | None:
    """How many ranks hold each index of [0, size) when that number is the same for every index
    (1: a partition; 2: kv heads each held by two ranks), else None. A sweep over the ranges' ends."""
    ends = sorted([(a, 1) for ranges in layout for a, _ in ranges] + [(b, -1) for ranges in layout for _, b in ranges])
    held, pos, counts = 0, 0, set()
    for at, step in ends:
        if at > pos:
            counts.add(held)            # indices [pos, at) are held by `held` ranks
            pos = at
        held += step
    if pos < size:
        counts.add(0)                   # [pos, size) by none
    return counts.pop() if len(counts) == 1 and 0 not in counts else None


def is_partition(layout: Layout, size: int) -> bool:
    """True when the ranks' sets are disjoint and together cover [0, size)."""
    flat = sorted(r for rs in layout for r in rs)
    pos = 0
    for a, b in flat:
        if a != pos:
            return False
        pos = b
    return pos == size


def is_even_chunks(layout: Layout, size: int) -> bool:
    """Rank r holds exactly the r-th of len(layout) equal contiguous chunks (what all_gather makes)."""
    return size % len(layout) == 0 and layout == even_layout(size, len(layout))


def is_whole_everywhere(layout: Layout, size: int) -> bool:
    """Every rank holds all of [0, size): one block shared by all ranks (a single kv head)."""
    return all(rs == ((0, size),) for rs in layout)
