"""A contact sheet of random samples: the quickest check that crops and orientation are right.

numpy and zlib only (shardio never imports Pillow). The sheet is a grid of the stored pixels, each tile
untouched (its corners are where a wrong orientation or crop shows) and numbered in a caption strip
below it, in a 3×5 pixel digit font; drawing the keys themselves would need a whole font, so the number
-> key (and caption) table is printed and written next to the image as ``OUT.json``.
The PNG is written by a minimal encoder: 8-bit RGB, one IDAT, every row with the "Up" filter (a numpy
subtraction, and photos compress ~20% better than unfiltered).
"""

from __future__ import annotations

import json
import math
import os
import struct
import zlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from shardio.errors import ShardError
from shardio.read.snapshot import DatasetSnapshot, open_dataset

__all__ = ["encode_png", "contact_sheet", "write_preview", "PreviewResult"]

# Captions longer than this are cut in the table: the sheet is for a glance, not for reading prompts.
CAPTION_CHARS = 60
_GAP = 4
_GAP_GREY = 48
# 3×5 digits, rows top to bottom, 3 bits each (MSB = left column).
_DIGITS = {
    "0": (7, 5, 5, 5, 7), "1": (2, 6, 2, 2, 7), "2": (7, 1, 7, 4, 7), "3": (7, 1, 7, 1, 7),
    "4": (5, 5, 7, 1, 1), "5": (7, 4, 7, 1, 7), "6": (7, 4, 7, 5, 7), "7": (7, 1, 1, 1, 1),
    "8": (7, 5, 7, 5, 7), "9": (7, 5, 7, 1, 7),
}


def encode_png(image: np.ndarray) -> bytes:
    """An H×W×3 uint8 array as PNG bytes (8-bit RGB, non-interlaced)."""
    if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3:
        raise ValueError(f"expected H×W×3 uint8, got {image.shape} {image.dtype}")
    height, width, _ = image.shape
    rows = np.ascontiguousarray(image).reshape(height, width * 3)
    filtered = np.empty((height, width * 3 + 1), np.uint8)
    filtered[:, 0] = 2  # filter type "Up": each byte minus the byte above it (mod 256)
    filtered[0, 1:] = rows[0]
    filtered[1:, 1:] = rows[1:] - rows[:-1]

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8 bits, colour type 2 (RGB)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header)
            + chunk(b"IDAT", zlib.compress(filtered.tobytes(), 6)) + chunk(b"IEND", b""))


def _caption_strip(width: int, number: int, scale: int) -> np.ndarray:
    """A black strip ``width`` wide holding ``number`` in white (``scale`` pixels per font pixel), to go
    under its tile; blank when the number does not fit (the table still lists it)."""
    text = str(number)
    strip = np.zeros((7 * scale, width, 3), np.uint8)
    if (4 * len(text) + 1) * scale > width:
        return strip
    for i, char in enumerate(text):
        bits = np.array([[(row >> (2 - col)) & 1 for col in range(3)] for row in _DIGITS[char]], bool)
        glyph = np.kron(bits, np.ones((scale, scale), bool))
        top, left = scale, (1 + 4 * i) * scale
        strip[top : top + 5 * scale, left : left + 3 * scale][glyph] = 255
    return strip


def _sample(snapshot: DatasetSnapshot, index: int) -> tuple[int, int]:
    shard = int(np.searchsorted(snapshot.offsets, index, side="right")) - 1
    return shard, index - int(snapshot.offsets[shard])


def contact_sheet(
    snapshot: DatasetSnapshot, indices: list[int], tile_height: int | None = None
) -> tuple[np.ndarray, list[dict[str, Any]]]:
    """The grid image of ``indices`` (dataset order positions) and one row of metadata per tile."""
    height, width, _ = snapshot.shape
    if tile_height and tile_height < height:
        rows_at = (np.arange(tile_height) * height // tile_height).astype(np.int64)
        tile_width = max(1, round(width * tile_height / height))
        cols_at = (np.arange(tile_width) * width // tile_width).astype(np.int64)
    else:
        rows_at, cols_at = np.arange(height), np.arange(width)
    th, tw = len(rows_at), len(cols_at)
    scale = max(1, min(th, tw) // 64)  # digits 5 px tall up to 127 px tiles, 10 px at 128-191 ...
    cell_h = th + 7 * scale  # the tile, then its number's strip
    columns = max(1, math.ceil(math.sqrt(len(indices))))
    rows = max(1, math.ceil(len(indices) / columns))
    sheet = np.full((rows * (cell_h + _GAP) + _GAP, columns * (tw + _GAP) + _GAP, 3), _GAP_GREY, np.uint8)
    table: list[dict[str, Any]] = []
    metas: dict[int, Any] = {}
    for number, index in enumerate(indices):
        shard, offset = _sample(snapshot, index)
        if shard not in metas:
            metas[shard] = snapshot.meta(shard)
        top = _GAP + (number // columns) * (cell_h + _GAP)
        left = _GAP + (number % columns) * (tw + _GAP)
        sheet[top : top + th, left : left + tw] = snapshot.pixels(shard)[offset][np.ix_(rows_at, cols_at)]
        sheet[top + th : top + cell_h, left : left + tw] = _caption_strip(tw, number, scale)
        key, caption = metas[shard].rows(offset, offset + 1)[0][:2]  # that line parsed, not the shard's
        if caption is not None and len(caption) > CAPTION_CHARS:
            caption = caption[: CAPTION_CHARS - 1] + "…"
        table.append({"number": number, "index": index, "key": key, "caption": caption,
                      "shard": snapshot.shards[shard].path})
    return sheet, table


@dataclass
class PreviewResult:
    out: str
    table_path: str
    shape: tuple[int, int, int]
    table: list[dict[str, Any]] = field(default_factory=list)


def write_preview(
    directory: str, out: str, *, n: int = 64, seed: int = 0, tile_height: int | None = None
) -> PreviewResult:
    """Write a contact sheet of ``n`` random samples (``seed`` picks them) to ``out`` and ``out``.json."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    snapshot = open_dataset(directory)
    total = len(snapshot)
    if total == 0:
        raise ShardError(f"{directory}: the manifest lists no samples; nothing to preview")
    rng = np.random.default_rng(seed)
    # Sorted: one pass over the shards, and the numbers read in dataset order.
    indices = sorted(int(i) for i in rng.choice(total, size=min(n, total), replace=False))
    sheet, table = contact_sheet(snapshot, indices, tile_height)
    parent = os.path.dirname(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    with open(out, "wb") as f:
        f.write(encode_png(sheet))
    table_path = out + ".json"
    with open(table_path, "w", encoding="utf-8") as f:
        json.dump({"dataset": directory, "seed": seed, "samples": total, "tiles": table}, f, indent=1,
                  ensure_ascii=False)
    return PreviewResult(out=out, table_path=table_path, shape=tuple(sheet.shape), table=table)
