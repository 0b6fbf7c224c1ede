"""PNG pictures from the standard library alone (zlib): an RGB image as rows of (r, g, b) tuples,
a few 3 x 5 pixel glyphs for numbers on it, and lines. Used by the schedule pictures
(runtime/trace.py) and the training loss curve (train/plot.py); no plotting package is needed."""
from __future__ import annotations

import struct
import zlib

__all__ = ["Image", "blank", "encode", "write", "text_width", "draw_text", "draw_line", "GLYPHS"]

Image = list[list[tuple[int, int, int]]]

# 3 x 5 glyphs, row by row
GLYPHS = {str(d): g for d, g in enumerate(
    ["111101101101111", "010110010010111", "111001111100111", "111001111001111", "101101111001001",
     "111100111001111", "111100111101111", "111001001001001", "111101111101111", "111101111001111"])}
GLYPHS.update({".": "000000000000010", "-": "000000111000000", " ": "0" * 15, "e": "000111111100111",
               "k": "100101110101101", "l": "110010010010111", "o": "000111101101111", "p": "000110101110100",
               "s": "000011010001110", "t": "010111010010001", "d": "001001111101111", "r": "000111100100100",
               "a": "000111011101111", "n": "000110101101101"})


def blank(width: int, height: int, color: tuple[int, int, int] = (255, 255, 255)) -> Image:
    return [[color] * width for _ in range(height)]


def encode(img: Image) -> bytes:
    """The image as PNG bytes (8-bit RGB, no filter)."""
    height, width = len(img), len(img[0])
    raw = b"".join(b"\x00" + bytes(c for px in line for c in px) for line in img)

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))


def write(img: Image, path: str) -> None:
    with open(path, "wb") as fh:
        fh.write(encode(img))


def text_width(text: str, px: int = 2) -> int:
    return len(text) * 4 * px - px


def draw_text(img: Image, text: str, x: int, y: int, px: int = 2, color: tuple[int, int, int] = (0, 0, 0)) -> None:
    """`text` (characters of GLYPHS) with its top-left corner at (x, y), each glyph pixel px x px;
    what falls outside the image is left out."""
    for ch in text:
        for i, bit in enumerate(GLYPHS[ch]):
            if bit == "1":
                for dy in range(px):
                    for dx in range(px):
                        yy, xx = y + (i // 3) * px + dy, x + (i % 3) * px + dx
                        if 0 <= yy < len(img) and 0 <= xx < len(img[0]):
                            img[yy][xx] = color
        x += 4 * px


def draw_line(img: Image, x0: int, y0: int, x1: int, y1: int, color: tuple[int, int, int], thick: int = 1) -> None:
    """A straight line from (x0, y0) to (x1, y1), `thick` pixels wide."""
    steps = max(abs(x1 - x0), abs(y1 - y0), 1)
    for s in range(steps + 1):
        x, y = round(x0 + (x1 - x0) * s / steps), round(y0 + (y1 - y0) * s / steps)
        for dy in range(thick):
            for dx in range(thick):
                if 0 <= y + dy < len(img) and 0 <= x + dx < len(img[0]):
                    img[y + dy][x + dx] = color
