"""A picture of expert parallelism: which rank holds which experts, and where each rank's tokens go.

    write(expert_parallel_picture(routing, experts=8, ep=2), "expert_parallel.png")
    python -m autoshard.testing.expert_picture docs/expert_parallel.png   # the README's: a small Mixtral

One column per data-parallel rank, grouped by expert-parallel group. In each column, top: a bar of the
rank's (token, expert) pairs of one MoE layer and microbatch, one color per expert, in the order
they are sent (grouped by owner rank); middle: one line per (rank, owner) pair, as thick as the
share of pairs sent there (a line to its own column: pairs that stay); bottom: the experts the rank
holds, a square of each one's color with its number. Mesh: runtime/mesh.py (ep divides dp; group g
is dp ranks g*ep ... g*ep+ep-1; rank e of a group owns experts e*E/ep ... (e+1)*E/ep - 1).
"""
from __future__ import annotations

from autoshard.errors import expert_split_problem
from autoshard.png import Image, blank, draw_line, draw_text, text_width

__all__ = ["expert_parallel_picture", "expert_color", "COLUMN", "BAR_Y", "BOX_Y"]

COLUMN, BAR_Y, BAR_H, BOX_Y, SQUARE = 160, 34, 16, 150, 26
_PALETTE = [(230, 25, 75), (60, 180, 75), (0, 130, 200), (245, 130, 48), (145, 30, 180), (70, 190, 190),
            (240, 50, 230), (128, 128, 0), (0, 0, 128), (170, 110, 40), (128, 0, 0), (0, 128, 128)]


def expert_color(e: int) -> tuple[int, int, int]:
    return _PALETTE[e % len(_PALETTE)]


def _fill(img: Image, x0: int, y0: int, x1: int, y1: int, color: tuple[int, int, int]) -> None:
    for y in range(y0, y1):
        img[y][x0:x1] = [color] * (x1 - x0)


def expert_parallel_picture(routing: list[list[int]], experts: int, ep: int) -> Image:
    """`routing[d]`: the expert of each (token, slot) pair on data-parallel rank d (one layer)."""
    dp, per = len(routing), experts // ep
    if (problem := expert_split_problem(dp, ep, experts)) is not None:
        raise ValueError(problem)
    img = blank(dp * COLUMN + 20, BOX_Y + SQUARE + 40)
    most = max(len(r) for r in routing) or 1
    for d, pairs in enumerate(routing):
        x = 10 + d * COLUMN
        e, group = d % ep, d // ep
        label = f"dp {d}  ep rank {e}"
        draw_text(img, label, x + (COLUMN - 20 - text_width(label)) // 2, 10)
        if e == 0 and d:                                  # the boundary between expert-parallel groups
            draw_line(img, x - 6, 0, x - 6, len(img) - 1, (120, 120, 120), 2)
        width = COLUMN - 20
        ordered = sorted(pairs, key=lambda ex: (ex // per, ex))     # as sent: grouped by owner rank
        done = 0                                                    # pairs drawn so far
        for owner in range(ep):
            mine = [ex for ex in ordered if ex // per == owner]
            if not mine:
                continue
            start = x + round(width * done / most)
            for ex in sorted(set(mine)):
                a, done = x + round(width * done / most), done + mine.count(ex)
                _fill(img, a, BAR_Y, x + round(width * done / most), BAR_Y + BAR_H, expert_color(ex))
            left = x + round(width * done / most)
            target = 10 + (group * ep + owner) * COLUMN + (COLUMN - 20) // 2
            thick = max(1, round(6 * len(mine) / most))
            draw_line(img, (start + left) // 2, BAR_Y + BAR_H + 2, target, BOX_Y - 4, (90, 90, 90), thick)
        for i in range(per):                              # the experts this rank holds
            ex = e * per + i
            sx = x + i * (SQUARE + 6)
            _fill(img, sx, BOX_Y, sx + SQUARE, BOX_Y + SQUARE, expert_color(ex))
            draw_text(img, str(ex), sx + (SQUARE - text_width(str(ex))) // 2, BOX_Y + 8, color=(255, 255, 255))
    return img
