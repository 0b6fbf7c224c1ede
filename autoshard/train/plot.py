"""The loss curve as a PNG (autoshard/png.py: no plotting package): loss against step, the axes
labelled with the first and last step and the lowest and highest loss, and named."""
from __future__ import annotations

from autoshard import png

__all__ = ["loss_curve"]

_INK, _AXIS, _GRID = (31, 119, 180), (60, 60, 60), (225, 225, 225)


def _number(x: float) -> str:
    return f"{x:.3g}".replace("e+0", "e").replace("e+", "e").replace("e-0", "e-")


def loss_curve(steps: list[int], losses: list[float], path: str, width: int = 720, height: int = 360) -> None:
    """Write the curve of `losses` at `steps` to `path`."""
    if not steps:
        raise ValueError("no losses to draw")
    img = png.blank(width, height)
    left, right, top, bottom = 70, width - 20, 20, height - 40
    lo, hi = min(losses), max(losses)
    if hi - lo < 1e-12:
        lo, hi = lo - 0.5, hi + 0.5
    s0, s1 = steps[0], max(steps[-1], steps[0] + 1)

    def xy(step: int, loss: float) -> tuple[int, int]:
        return (left + round((step - s0) / (s1 - s0) * (right - left)),
                bottom - round((loss - lo) / (hi - lo) * (bottom - top)))
    for k in range(5):                                    # horizontal grid lines
        y = top + k * (bottom - top) // 4
        png.draw_line(img, left, y, right, y, _GRID)
    png.draw_line(img, left, top, left, bottom, _AXIS, 2)
    png.draw_line(img, left, bottom, right, bottom, _AXIS, 2)
    points = [xy(s, v) for s, v in zip(steps, losses)]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        png.draw_line(img, x0, y0, x1, y1, _INK, 2)
    if len(points) == 1:
        png.draw_line(img, *points[0], *points[0], _INK, 3)
    for value, y in ((hi, top), (lo, bottom)):
        text = _number(value)
        png.draw_text(img, text, left - 8 - png.text_width(text), y - 5)
    for step, x in ((s0, left), (steps[-1], xy(steps[-1], lo)[0])):
        text = str(step)
        png.draw_text(img, text, x - png.text_width(text) // 2, bottom + 10)
    png.draw_text(img, "loss", 8, (top + bottom) // 2 - 5)
    png.draw_text(img, "step", (left + right - png.text_width("step")) // 2, bottom + 10)
    png.write(img, path)
