"""Tier (a): the layout algebra on its own."""
import pytest

from autoshard.passes.sharding.index_sets import (
    LayoutError,
    Segment,
    compress,
    even_layout,
    expand,
    is_even_chunks,
    is_partition,
    layout_from_segments,
    local_size,
    positions_within,
    window,
)


def test_even_layout_and_partition():
    lay = even_layout(12, 3)
    assert lay == (((0, 4),), ((4, 8),), ((8, 12),))
    assert is_partition(lay, 12) and local_size(lay) == 4
    with pytest.raises(LayoutError, match="12 is not divisible by tp=5"):
        even_layout(12, 5)


def test_strided_segments_for_fused_qkv():
    # q, k, v of 8 each over 2 ranks: each rank holds its half of each (Megatron's strided split)
    lay = layout_from_segments([Segment(0, 8), Segment(8, 8), Segment(16, 8)], 2)
    assert lay == (((0, 4), (8, 12), (16, 20)), ((4, 8), (12, 16), (20, 24)))
    assert window(lay, 8, 16) == (((0, 4),), ((4, 8),))


def test_shared_blocks_when_fewer_blocks_than_ranks():
    # 2 kv heads of 4 over 4 ranks: ranks 0,1 share head 0, ranks 2,3 head 1
    lay = layout_from_segments([Segment(0, 8, granularity=4)], 4)
    assert lay == (((0, 4),), ((0, 4),), ((4, 8),), ((4, 8),))
    assert not is_partition(lay, 8)
    with pytest.raises(LayoutError, match="tp=4 does not divide 6 blocks"):
        layout_from_segments([Segment(0, 24, granularity=4)], 4)


def test_expand_compress_roundtrip_and_off_block():
    lay = even_layout(4, 2)                      # heads
    flat = expand(lay, 16)                       # head_dim 16
    assert flat == (((0, 32),), ((32, 64),))
    assert compress(flat, 16) == lay
    assert compress(even_layout(48, 2), 16) is None   # 24 features per rank is not whole heads


def test_positions_within():
    assert positions_within(((0, 4),), ((2, 4),)) == ((2, 4),)
    assert positions_within(((4, 8), (12, 16)), ((12, 14),)) == ((4, 6),)
    assert positions_within(((0, 4),), ((3, 6),)) is None


def test_even_chunks():
    assert is_even_chunks(even_layout(8, 4), 8)
    assert not is_even_chunks((((0, 2),), ((4, 6),)), 8)                 # gaps: not a partition
    assert not is_even_chunks((((2, 4),), ((0, 2),)), 4)                 # chunks, but not in rank order
    assert not is_even_chunks((((0, 2), (4, 6)), ((2, 4), (6, 8))), 8)   # strided (fused QKV)
