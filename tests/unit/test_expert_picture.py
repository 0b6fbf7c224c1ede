"""The expert-parallel picture (runtime/expert_picture.py) draws what the mesh does: each rank's
squares are its own experts' colors, and its token bar has each expert's share of its pairs."""
from collections import Counter

import pytest

from autoshard.runtime.expert_picture import BAR_Y, BOX_Y, COLUMN, SQUARE, expert_color, expert_parallel_picture

ROUTING = [[0, 1, 1, 5, 6, 6, 6, 7], [2, 2, 4, 4, 4, 4, 3, 0], [7, 7, 7, 7, 7, 7, 7, 7], [0, 1, 2, 3, 4, 5, 6, 7]]


def test_each_rank_shows_its_experts_and_where_its_pairs_go():
    img = expert_parallel_picture(ROUTING, experts=8, ep=2)
    colors = {expert_color(e): e for e in range(8)}
    for d, pairs in enumerate(ROUTING):
        x0, x1 = 10 + d * COLUMN, 10 + (d + 1) * COLUMN - 20
        held = {colors[c] for c in img[BOX_Y + SQUARE // 2][x0:x1] if c in colors}
        assert held == set(range(4 * (d % 2), 4 * (d % 2) + 4))      # ep rank 0: experts 0-3, rank 1: 4-7
        bar = Counter(colors[c] for c in img[BAR_Y + 2][x0:x1] if c in colors)
        want = Counter(pairs)
        assert set(bar) == set(want)
        for e, n in want.items():          # 140 pixels for the longest bar of 8 pairs
            assert abs(bar[e] - 140 * n / 8) <= 1


def test_refuses_an_ep_that_does_not_divide():
    with pytest.raises(ValueError, match="ep=3 must divide dp=4: expert-parallel groups"):
        expert_parallel_picture(ROUTING, experts=8, ep=3)
