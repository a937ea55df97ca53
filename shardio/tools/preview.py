"""A contact sheet of random samples: the quickest check that crops and orientation are right.

A bucketed dataset (``mode: bucket``: each shard one bucket's shape) is drawn as a row per bucket, a few
random samples of that bucket each, the row labelled with the bucket's shape (``HxW``, in the digit font)
on its left: whether each aspect ratio's images look right shows at a glance.

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

from shardio.errors import ShardError, UsageError
from shardio.format import NONE
from shardio.read.snapshot import DatasetSnapshot, open_dataset

__all__ = ["encode_png", "bucket_samples", "bucket_sheet", "contact_sheet", "write_preview", "PreviewResult"]

# Captions longer than this are cut in the table: the sheet is for a glance, not for reading prompts.
CAPTION_CHARS = 60
_GAP = 4
_GAP_GREY = 48
# 3×5 digits, rows top to bottom, 3 bits each (MSB = left column).
_DIGITS = {
    "0": (7, 5, 5, 5, 7), "1": (2, 6, 2, 2, 7), "2": (7, 1, 7, 4, 7), "3": (7, 1, 7, 1, 7),
    "4": (5, 5, 7, 1, 1), "5": (7, 4, 7, 1, 7), "6": (7, 4, 7, 5, 7), "7": (7, 1, 1, 1, 1),
    "8": (7, 5, 7, 5, 7), "9": (7, 5, 7, 1, 7), "x": (0, 5, 2, 5, 0),
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


def _text_width(text: str, scale: int) -> int:
    return (4 * len(text) + 1) * scale


def _caption_strip(width: int, number: int | str, scale: int) -> np.ndarray:
    """A black strip ``width`` wide holding ``number`` (digits and ``x``) in white (``scale`` pixels per
    font pixel), to go under its tile; blank when the text does not fit (the table still lists it)."""
    text = str(number)
    strip = np.zeros((7 * scale, width, 3), np.uint8)
    if _text_width(text, scale) > width:
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


def _tile_grid(height: int, width: int, tile_height: int | None) -> tuple[np.ndarray, np.ndarray]:
    """The rows and columns of a ``height`` x ``width`` image a tile shows (nearest neighbour when
    ``tile_height`` is smaller than the image; all of them otherwise)."""
    if tile_height and tile_height < height:
        rows_at = (np.arange(tile_height) * height // tile_height).astype(np.int64)
        tile_width = max(1, round(width * tile_height / height))
        cols_at = (np.arange(tile_width) * width // tile_width).astype(np.int64)
        return rows_at, cols_at
    return np.arange(height), np.arange(width)


def _digit_scale(th: int, tw: int) -> int:
    return max(1, min(th, tw) // 64)  # digits 5 px tall up to 127 px tiles, 10 px at 128-191 ...


class _Tiles:
    """Reads samples for tiles: each shard's metadata once, the caption cut for the table."""

    def __init__(self, snapshot: DatasetSnapshot) -> None:
        self.snapshot = snapshot
        self.metas: dict[int, Any] = {}

    def pixels(self, index: int, rows_at: np.ndarray, cols_at: np.ndarray) -> np.ndarray:
        shard, offset = _sample(self.snapshot, index)
        return self.snapshot.pixels(shard)[offset][np.ix_(rows_at, cols_at)]

    def row(self, number: int, index: int) -> dict[str, Any]:
        shard, offset = _sample(self.snapshot, index)
        if shard not in self.metas:
            self.metas[shard] = self.snapshot.meta(shard)
        key, caption = self.metas[shard].rows(offset, offset + 1)[0][:2]  # that line parsed, not the shard's
        if caption is not None and len(caption) > CAPTION_CHARS:
            caption = caption[: CAPTION_CHARS - 1] + "…"
        return {"number": number, "index": index, "key": key, "caption": caption,
                "shard": self.snapshot.shards[shard].path}


def contact_sheet(
    snapshot: DatasetSnapshot, indices: list[int], tile_height: int | None = None
) -> tuple[np.ndarray, list[dict[str, Any]]]:
    """The grid image of ``indices`` (dataset order positions) and one row of metadata per tile."""
    height, width, _ = snapshot.shape
    rows_at, cols_at = _tile_grid(height, width, tile_height)
    th, tw = len(rows_at), len(cols_at)
    scale = _digit_scale(th, tw)
    cell_h = th + 7 * scale  # the tile, then its number's strip
    columns = max(1, math.ceil(math.sqrt(len(indices))))
    rows = max(1, math.ceil(len(indices) / columns))
    sheet = np.full((rows * (cell_h + _GAP) + _GAP, columns * (tw + _GAP) + _GAP, 3), _GAP_GREY, np.uint8)
    table: list[dict[str, Any]] = []
    tiles = _Tiles(snapshot)
    for number, index in enumerate(indices):
        top = _GAP + (number // columns) * (cell_h + _GAP)
        left = _GAP + (number % columns) * (tw + _GAP)
        sheet[top : top + th, left : left + tw] = tiles.pixels(index, rows_at, cols_at)
        sheet[top + th : top + cell_h, left : left + tw] = _caption_strip(tw, number, scale)
        table.append(tiles.row(number, index))
    return sheet, table


def bucket_sheet(
    snapshot: DatasetSnapshot, rows: list[tuple[int, list[int]]], tile_height: int | None = None
) -> tuple[np.ndarray, list[dict[str, Any]]]:
    """A row per bucket: ``rows`` is (bucket id, its samples' dataset positions) in drawing order; each row
    starts with its bucket's ``HxW`` label, then its tiles, numbered on from the row above. Returns the
    image and one row of metadata per tile (with its ``bucket`` and ``shape``)."""
    grids = {bucket: _tile_grid(*snapshot.buckets[bucket], tile_height) for bucket, _ in rows}
    scale = min(_digit_scale(len(r), len(c)) for r, c in grids.values())
    labels = {bucket: "x".join(map(str, snapshot.buckets[bucket])) for bucket, _ in rows}
    label_w = max(_text_width(text, scale) for text in labels.values()) + _GAP
    heights = [max(len(grids[b][0]) + 7 * scale, 7 * scale) for b, _ in rows]
    widths = [len(indices) * (len(grids[b][1]) + _GAP) for b, indices in rows]
    sheet = np.full((sum(heights) + _GAP * (len(rows) + 1), _GAP + label_w + max(widths), 3), _GAP_GREY,
                    np.uint8)
    table: list[dict[str, Any]] = []
    tiles = _Tiles(snapshot)
    top = _GAP
    for (bucket, indices), cell_h in zip(rows, heights):
        rows_at, cols_at = grids[bucket]
        th, tw = len(rows_at), len(cols_at)
        sheet[top : top + 7 * scale, _GAP : _GAP + label_w - _GAP] = _caption_strip(label_w - _GAP,
                                                                                 labels[bucket], scale)
        left = _GAP + label_w
        for index in indices:
            number = len(table)
            sheet[top : top + th, left : left + tw] = tiles.pixels(index, rows_at, cols_at)
            sheet[top + th : top + th + 7 * scale, left : left + tw] = _caption_strip(tw, number, scale)
            table.append({**tiles.row(number, index), "bucket": bucket,
                          "shape": list(snapshot.buckets[bucket])})
            left += tw + _GAP
        top += cell_h + _GAP
    return sheet, table


def bucket_samples(snapshot: DatasetSnapshot, per_bucket: int, rng: np.random.Generator
                   ) -> list[tuple[int, list[int]]]:
    """Up to ``per_bucket`` random samples of each bucket that has any, as (bucket, sorted dataset
    positions), buckets in id order. Works on the shard columns: no list of a bucket's samples is made."""
    out = []
    counts = np.diff(snapshot.offsets)
    for bucket in range(len(snapshot.buckets)):
        shards = np.flatnonzero(np.asarray(snapshot.shard_buckets) == bucket)
        ends = np.cumsum(counts[shards])
        total = int(ends[-1]) if len(ends) else 0
        if total == 0:
            continue
        ranks = rng.choice(total, size=min(per_bucket, total), replace=False)
        at = np.searchsorted(ends, ranks, side="right")  # which of the bucket's shards holds each rank
        starts = ends[at] - counts[shards][at]
        positions = snapshot.offsets[shards[at]] + (ranks - starts)
        out.append((bucket, sorted(int(p) for p in positions)))
    return out


@dataclass
class PreviewResult:
    out: str
    table_path: str
    shape: tuple[int, int, int]
    table: list[dict[str, Any]] = field(default_factory=list)
    buckets: list[dict[str, Any]] = field(default_factory=list)  # a bucketed dataset's rows, in order


def write_preview(
    directory: str, out: str, *, n: int = 64, seed: int = 0, tile_height: int | None = None
) -> PreviewResult:
    """Write a contact sheet of ``n`` random samples (``seed`` picks them) to ``out`` and ``out``.json.
    A bucketed dataset's sheet has a row per bucket holding ``ceil(n / buckets with samples)`` of its
    samples (all of them, if fewer). ``out`` must end in ``.png``: the sheet is a PNG, and a file named
    ``.jpg`` holding PNG bytes is misread by whatever trusts its name (UsageError, nothing written)."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if not out.lower().endswith(".png"):
        raise UsageError(f"{out}: the preview is a PNG (shardio writes no other image format), so its name "
                         "must end in .png; HINT: --out grid.png")
    snapshot = open_dataset(directory)
    if snapshot.encoding == NONE:
        raise UsageError(f"{directory}: this dataset keeps no pixels (encoding: none: its model outputs are the "
                         "dataset), so there is no picture to preview; `shardio info` lists its outputs")
    total = len(snapshot)
    if total == 0:
        raise ShardError(f"{directory}: the manifest lists no samples; nothing to preview")
    rng = np.random.default_rng(seed)
    buckets: list[dict[str, Any]] = []
    if snapshot.is_bucketed:
        filled = len(set(np.asarray(snapshot.shard_buckets)[np.diff(snapshot.offsets) > 0].tolist()))
        rows = bucket_samples(snapshot, math.ceil(n / filled), rng)
        sheet, table = bucket_sheet(snapshot, rows, tile_height)
        sizes = np.bincount(np.asarray(snapshot.shard_buckets, dtype=np.int64),
                            weights=np.diff(snapshot.offsets), minlength=len(snapshot.buckets))
        buckets = [{"bucket": b, "shape": list(snapshot.buckets[b]), "samples": int(sizes[b]),
                    "tiles": len(indices)} for b, indices in rows]
    else:
        # Sorted: one pass over the shards, and the numbers read in dataset order.
        indices = sorted(int(i) for i in rng.choice(total, size=min(n, total), replace=False))
        sheet, table = contact_sheet(snapshot, indices, tile_height)
    parent = os.path.dirname(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    with open(out, "wb") as f:
        f.write(encode_png(sheet))
    table_path = out + ".json"
    with open(table_path, "w", encoding="utf-8") as f:
        described = {"dataset": directory, "seed": seed, "samples": total, "tiles": table}
        if buckets:
            described["buckets"] = buckets
        json.dump(described, f, indent=1, ensure_ascii=False)
    return PreviewResult(out=out, table_path=table_path, shape=tuple(sheet.shape), table=table,
                         buckets=buckets)
