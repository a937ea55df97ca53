"""A shard's metadata (its ``.jsonl``): the lines found at once, each parsed when a batch first asks for it.

A shuffled batch draws one or two samples from each of up to ``shuffle_window`` shards: parsing every
line of each shard it touches (``json.loads`` of 1,000 lines per sample used) made the first batch of a
1M-sample dataset cost 0.4-1 s. So ``ShardMeta`` keeps the bytes and the line ends (one vectorised
search for ``\\n``, the count checked against the manifest at once) and parses a line the first time it
is read, once: the row is kept until every line is parsed, then the bytes go. A bad line (not UTF-8,
not JSON, not a record with a ``key``, a bad ``box``, ``width``/``height`` or ``crop``) is found when it is
first read, named by file, line and sample, and rows elsewhere in the shard read normally.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from shardio.errors import ShardFormatError, ShardIntegrityError

__all__ = ["Columns", "Row", "ShardMeta", "rows_columns"]

# One sample's line, parsed: (key, txt, cls, json, box, size, crop), ``None`` where the line has no such
# field, but ``box`` (x0, y0, x1, y1), end-exclusive, the picture's pixels in a ``mode: pad`` dataset: the
# whole image (0, 0, W, H) where the line has none; ``size`` the source's upright (height, width), -1 where
# the line has none; ``crop`` (top, left) what the centre crop cut, in source pixels: where the line has
# none, the dataset's default (``shardio.format.line_crop_default``: (0, 0) or (-1, -1), unknown).
Row = tuple[str, "str | None", "int | None", "dict[str, Any] | None", Sequence[int], Sequence[int],
            Sequence[int]]
Columns = tuple[list[str], "list[str | None]", np.ndarray, list[Any], np.ndarray, np.ndarray, np.ndarray]

_HINT = "HINT: run `preprocess verify DIR --repair`"
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


class _Lines:
    """One shard's lines: the bytes, where each line ends, and the rows parsed so far (shared by every
    ``ShardMeta`` window of the shard)."""

    def __init__(self, path: str, data: bytes, samples: int, height: int, width: int,
                 local_path: str | None = None, missing_crop: tuple[int, int] = (-1, -1)) -> None:
        # Split on b"\n" only: U+2028/U+0085 in captions are no line breaks (json.dumps(ensure_ascii=False)
        # leaves them unescaped), and 0x0A never occurs inside a UTF-8 sequence.
        ends = np.flatnonzero(np.frombuffer(data, np.uint8) == 10)
        if data and data[-1:] != b"\n":
            ends = np.append(ends, len(data))
        if len(ends) != samples:
            raise ShardIntegrityError(f"{path}: {len(ends)} lines, manifest says {samples} samples")
        self.path, self.count, self.height, self.width = path, samples, height, width
        self.whole_image = (0, 0, width, height)  # the box of a line without one
        self.missing_crop = missing_crop  # the crop of a line without one
        self.flags: tuple[bool, bool, bool] | None = None  # has txt, cls, json: known once all are parsed
        # (bytes, ends) in one attribute, read once per row: dropped (None) when every row is parsed,
        # so a thread that read it before then still holds both.
        ends = ends.astype(np.int32 if len(data) < 2**31 else np.int64)
        # A local file's lines are read again when parsed (one pread per batch piece) instead of held:
        # a shuffled first batch touches up to 256 shards, whose .jsonl (~0.5 MB each for LAION's
        # captions and json) would otherwise stay in memory; bytes from elsewhere (the object-store
        # cache) are held.
        self.local_path = local_path
        self.source: tuple[bytes | None, np.ndarray] | None = (None if local_path else data, ends)
        self.parsed: dict[int, Row] = {}

    def rows(self, start: int, stop: int) -> list[Row]:
        source, parsed = self.source, self.parsed
        missing = [i for i in range(start, stop) if i not in parsed]
        if missing:
            assert source is not None  # None only once every row is parsed
            data, ends = source
            begin = 0 if missing[0] == 0 else int(ends[missing[0] - 1]) + 1
            end = int(ends[missing[-1]])
            chunk = data[begin:end] if data is not None else self._read(begin, end)
            for i in missing:
                parsed[i] = self._parse(chunk, begin, ends, i)
        if source is not None and len(parsed) == self.count:
            self.source = None  # every row parsed: the bytes are no longer needed
        return [parsed[i] for i in range(start, stop)]

    def _read(self, begin: int, end: int) -> bytes:
        assert self.local_path is not None
        try:
            fd = os.open(self.local_path, os.O_RDONLY)
        except FileNotFoundError as e:
            raise ShardIntegrityError(f"{self.path}: deleted since its shard was opened (retention collected its "
                                      "generation, or it was removed): open the dataset again") from e
        try:
            data = os.pread(fd, end - begin, begin)
        finally:
            os.close(fd)
        if len(data) != end - begin:
            raise ShardIntegrityError(f"{self.path}: shorter than when it was opened ({begin + len(data)} of {end} "
                                      f"bytes: truncated or overwritten while read); {_HINT}")
        return data

    def has(self) -> tuple[bool, bool, bool]:
        """Whether any line has ``txt``, ``cls``, ``json`` (parses every line)."""
        if self.flags is None:
            rows = self.rows(0, self.count)
            self.flags = (any(row[1] is not None for row in rows), any(row[2] is not None for row in rows),
                          any(row[3] is not None for row in rows))
        return self.flags

    def _parse(self, chunk: bytes, begin: int, ends: np.ndarray, i: int) -> Row:
        start, stop = (0 if i == 0 else int(ends[i - 1]) + 1), int(ends[i])
        try:
            # The writer emits UTF-8 only: a bad byte is corruption (a flipped bit, a foreign file).
            text = chunk[start - begin:stop - begin].decode("utf-8")
        except UnicodeDecodeError as e:
            raise self._bad(i, f"not UTF-8 ({e.reason} at byte {start + e.start})") from e
        try:
            record = json.loads(text)
        except json.JSONDecodeError as e:
            raise self._bad(i, f"invalid JSON ({e.msg})") from e
        except RecursionError as e:  # a forged line nested deeper than Python's recursion limit
            raise self._bad(i, "JSON nested too deeply to read") from e
        # A corrupt row otherwise surfaces as a bare KeyError or AttributeError in a batch.
        if not isinstance(record, dict) or not isinstance(record.get("key"), str):
            raise self._bad(i, "not a sample record (a JSON object with a \"key\")")
        label = record.get("cls")
        # The batch's ``cls`` is int64: a label that is no int64 (a string, a list, 1.7, 10**30, true) would
        # fail there without a file, or become another label (int64(1.7) is 1).
        if label is not None and (type(label) is not int or not _INT64_MIN <= label <= _INT64_MAX):
            raise self._bad(i, f"cls {str(label)[:40]!r} is not an integer label (int64) or null")
        box, crop = record.get("box"), record.get("crop")
        size = (self._side(record, "height", i), self._side(record, "width", i))
        return (record["key"], record.get("txt"), label, record.get("json"),
                self.whole_image if box is None else self._box(box, i), size,
                self.missing_crop if crop is None else self._crop(crop, size, i))

    def _bad(self, i: int, problem: str) -> ShardFormatError:
        return ShardFormatError(f"{self.path}: line {i + 1} (sample {i}): {problem}; {_HINT}")

    def _side(self, record: dict[str, Any], name: str, i: int) -> int:
        """The source's ``width`` or ``height``: a positive int, -1 where the line has none."""
        value = record.get(name)
        if value is None:
            return -1
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise self._bad(i, f"{name} {repr(value)[:40]} is not the source's size in pixels "
                               "(a positive integer)")
        return value

    def _crop(self, crop: Any, size: tuple[int, int], i: int) -> Sequence[int]:
        height, width = size
        # Inside the source (whose size may be unknown: -1), so a conditioning value is never a forged one.
        if (not isinstance(crop, list) or len(crop) != 2
                or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in crop)
                or (height > 0 and crop[0] >= height) or (width > 0 and crop[1] >= width)):
            raise self._bad(i, f"crop {str(crop)[:40]} is not [top, left] ints with 0 <= top < height "
                               f"{height}, 0 <= left < width {width} (the source's pixels)")
        return crop

    def _box(self, box: Any, i: int) -> Sequence[int]:
        width, height = self.width, self.height
        # A box outside the image or empty would make crops read outside the sample or divide by zero.
        if (not isinstance(box, list) or len(box) != 4
                or not all(isinstance(v, int) and not isinstance(v, bool) for v in box)
                or not (0 <= box[0] < box[2] <= width and 0 <= box[1] < box[3] <= height)):
            raise self._bad(i, f"box {box!r} is not [x0, y0, x1, y1] ints with 0 <= x0 < x1 <= {width}, "
                               f"0 <= y0 < y1 <= {height}")
        return box


class ShardMeta:
    """Rows ``[start, stop)`` of one shard's metadata (the whole shard unless a subset cut it).

    ``rows(a, b)`` parses only those lines (each line once, whoever asks) into ``Row`` tuples; the columns
    (``rows_columns``) ``keys``, ``txt``, ``cls`` (int64, -1: no label), ``json``, ``box`` (int32 [N, 4]),
    ``original_size`` and ``crop_top_left`` (int64 [N, 2]) parse every row of the window when first asked.
    ``has_txt``, ``has_cls``, ``has_json`` are the whole shard's (a subset's batch schema is its shards')."""

    def __init__(self, lines: _Lines, start: int = 0, stop: int | None = None) -> None:
        self._lines, self._start = lines, start
        self._stop = lines.count if stop is None else stop
        self._columns: Columns | None = None

    @classmethod
    def from_bytes(cls, path: str, data: bytes, samples: int, height: int, width: int,
                   missing_crop: tuple[int, int] = (-1, -1)) -> ShardMeta:
        """The metadata of the shard whose ``.jsonl`` at ``path`` holds ``data``; raises
        ``ShardIntegrityError`` now if its line count is not the manifest's ``samples``. ``missing_crop``:
        the crop of a line without one (``shardio.format.line_crop_default`` of the dataset's config)."""
        return cls(_Lines(path, data, samples, height, width, missing_crop=missing_crop))

    @classmethod
    def from_file(cls, path: str, local_path: str, data: bytes, samples: int, height: int, width: int,
                  missing_crop: tuple[int, int] = (-1, -1)) -> ShardMeta:
        """``from_bytes`` for the local file ``local_path`` that held ``data``: only the line ends are kept,
        and a row's line is read again from the file when it is first parsed."""
        return cls(_Lines(path, data, samples, height, width, local_path, missing_crop))

    def __len__(self) -> int:
        return self._stop - self._start

    def rows(self, start: int, stop: int) -> list[Row]:
        """The parsed rows ``[start, stop)`` of this window (slice bounds, clipped alike)."""
        if not 0 <= start <= stop <= len(self):  # a batch's pieces are in range: no slice object
            start, stop, _ = slice(start, stop).indices(len(self))
            stop = max(start, stop)
        return self._lines.rows(self._start + start, self._start + stop)

    def window(self, start: int, stop: int) -> ShardMeta:
        """Rows ``[start, stop)`` of this window, sharing its parsed rows."""
        start, stop, _ = slice(start, stop).indices(len(self))
        return ShardMeta(self._lines, self._start + start, self._start + max(start, stop))

    def _all(self) -> Columns:
        if self._columns is None:
            self._columns = rows_columns(self.rows(0, len(self)))
        return self._columns

    @property
    def keys(self) -> list[str]:
        return self._all()[0]

    @property
    def txt(self) -> list[str | None]:
        return self._all()[1]

    @property
    def cls(self) -> np.ndarray:
        return self._all()[2]

    @property
    def json(self) -> list[dict[str, Any] | None]:
        return self._all()[3]

    @property
    def box(self) -> np.ndarray:
        return self._all()[4]

    @property
    def original_size(self) -> np.ndarray:
        return self._all()[5]

    @property
    def crop_top_left(self) -> np.ndarray:
        return self._all()[6]

    @property
    def has_txt(self) -> bool:
        return self._lines.has()[0]

    @property
    def has_cls(self) -> bool:
        return self._lines.has()[1]

    @property
    def has_json(self) -> bool:
        return self._lines.has()[2]


def rows_columns(rows: list[Row]) -> Columns:
    """``rows`` as the columns (keys, txt, cls int64, json, box int32 [N, 4], original_size and crop_top_left
    int64 [N, 2]): one pass per field."""
    return ([row[0] for row in rows], [row[1] for row in rows],
            np.array([-1 if row[2] is None else row[2] for row in rows], dtype=np.int64), [row[3] for row in rows],
            np.array([row[4] for row in rows], dtype=np.int32).reshape(len(rows), 4),
            np.array([row[5] for row in rows], dtype=np.int64).reshape(len(rows), 2),
            np.array([row[6] for row in rows], dtype=np.int64).reshape(len(rows), 2))
