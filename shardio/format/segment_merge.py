"""Compaction as columns: consecutive index segments merged into one without an object per shard or input.

``merge_columns`` gives the same bytes (hence the same name) as ``encode_segment(merge_segments(
[decode_segment(...)], from_start))`` but works on ``SegmentColumns``: the live inputs are found with
numpy over the input-name columns (as ``fold_segments`` does), their rows and their shards' row ranges
are gathered, and each string table is rebuilt by copying the selected byte ranges (contiguous runs as
slices, the rest through chunked index arrays). Memory is a few numpy arrays per row merged, not ~1.4 KB
of Python objects per shard (a top-tier compaction at 2.3M shards would otherwise build ~3 GB of them).
What it copies is checked as ``decode_segment`` checks it: UTF-8 strings, safe shard paths, known
checksum codes, digest widths; anything malformed is a ShardFormatError naming its segment.
"""

from __future__ import annotations

import codecs
from dataclasses import dataclass

import numpy as np

from shardio.errors import ShardFormatError
from shardio.store.checksum import ALGORITHM_CODES, ALGORITHM_NAMES, DIGEST_BYTES, XXH3_128
from shardio.format.index import BUCKET_COLUMN, segment_bytes, with_fence
from shardio.format.model_outputs import OUTPUT_DIGEST_COLUMN
from shardio.format.segment_columns import SegmentColumns
from shardio.format.names import check_dataset_path
from shardio.format.spec import SHARDS_DIR

__all__ = ["MergedSegment", "merge_columns"]

_INPUT_INTS = ("input_size", "input_mtime_ns", "input_samples", "input_failed")
_SHARD_INTS = ("shard_samples", "shard_bytes", "shard_meta_bytes")
_XXH3 = ALGORITHM_CODES[XXH3_128]
_CHUNK = 1 << 18  # bytes gathered per index array (a few MB of int64 temporaries)
_SHARD_PREFIX = np.frombuffer(f"{SHARDS_DIR}/".encode(), dtype=np.uint8)


@dataclass(frozen=True)
class MergedSegment:
    """A merged segment's bytes and the row counts a root's ``SegmentRef`` records."""

    data: bytes
    shards: int
    inputs: int
    removed: int
    samples: int


# (segment number, positions in the output, rows in that segment), one per segment that contributes
_Parts = list[tuple[int, np.ndarray, np.ndarray]]


def merge_columns(segments: list[SegmentColumns], from_start: bool, fence: str = "") -> MergedSegment | None:
    """``segments`` (consecutive, oldest first) as one segment; None when the merge says nothing (no live
    input, no removal still needed). Later inputs win and removals apply as ``fold`` says; a removal is
    kept only when segments before the run may hold the name (``from_start`` False) and no merged input
    replaces it (``merge_segments``'s rule). ``fence``: as ``encode_segment``'s."""
    for segment in segments:
        _check_columns(segment)
    width = max([1] + [_widest(s, t) for s in segments for t in ("input_name", "removed")])
    own = [_keys(s, "input_name", width) for s in segments]
    for segment, keys in zip(segments, own):
        if len(keys) > 1 and not np.all(keys[1:] > keys[:-1]) and len(np.unique(keys)) != len(keys):
            raise ShardFormatError(f"{segment.path}: input_name lists a name twice (its names are unique: spec, "
                                   '"Index")')
    removed = [_keys(s, "removed", width) for s in segments]

    # The live inputs: a name lives in the newest segment naming it, as an input or a removal.
    later = np.zeros(0, dtype=own[0].dtype if own else "S1")
    keep: list[np.ndarray] = [np.zeros(0, bool)] * len(segments)
    for k in reversed(range(len(segments))):
        keep[k] = ~np.isin(own[k], later) if len(later) else np.ones(len(own[k]), bool)
        later = np.concatenate([later, own[k], removed[k]])
    del later
    live_keys = np.concatenate([own[k][keep[k]] for k in range(len(segments))]) if segments else np.zeros(0, "S1")
    input_segment = np.concatenate([np.full(int(keep[k].sum()), k, np.int64) for k in range(len(segments))]
                                   or [np.zeros(0, np.int64)])
    input_row = np.concatenate([np.flatnonzero(keep[k]) for k in range(len(segments))] or [np.zeros(0, np.int64)])
    order = np.argsort(live_keys, kind="stable")
    live_keys, input_segment, input_row = live_keys[order], input_segment[order], input_row[order]
    del own, keep, order

    removed_parts: _Parts = []
    if not from_start and segments:
        every = np.concatenate(removed)
        source = np.repeat(np.arange(len(segments)), [len(r) for r in removed])
        rows = np.concatenate([np.arange(len(r)) for r in removed])
        every, first = np.unique(every, return_index=True)
        still = ~np.isin(every, live_keys)
        removed_parts = _parts(source[first][still], rows[first][still], len(segments))
        removed_count = int(still.sum())
    else:
        removed_count = 0
    del removed, live_keys
    inputs = len(input_row)
    if not inputs and not removed_count:
        return None

    input_parts = _parts(input_segment, input_row, len(segments))
    arrays: dict[str, np.ndarray] = {}
    for name in _INPUT_INTS:
        arrays[name] = _gather(segments, name, input_parts, inputs, "<i8")
    arrays["input_listed"] = (_gather(segments, "input_listed", input_parts, inputs, None) != 0).astype(np.uint8)
    starts = _gather(segments, "input_first_shard", input_parts, inputs, "<i8")
    counts = np.empty(inputs, dtype=np.int64)
    for k, position, rows in input_parts:
        first = segments[k].arrays["input_first_shard"]
        counts[position] = first[rows + 1] - first[rows]
    arrays["input_first_shard"] = np.zeros(inputs + 1, dtype="<i8")
    np.cumsum(counts, out=arrays["input_first_shard"][1:])
    shards = int(arrays["input_first_shard"][-1])
    shard_segment = np.repeat(input_segment, counts)
    shard_row = np.arange(shards, dtype=np.int64) - np.repeat(arrays["input_first_shard"][:-1] - starts, counts)
    del starts, counts, input_segment, input_row
    shard_parts = _parts(shard_segment, shard_row, len(segments))
    del shard_segment, shard_row
    shard_parts = [(k, position, _in_path_order(segments[k], rows)) for k, position, rows in shard_parts]

    for name in _SHARD_INTS:
        arrays[name] = _gather(segments, name, shard_parts, shards, "<i8")
    codes = _gather(segments, "shard_algorithm", shard_parts, shards, np.uint8)
    for k, position, rows in shard_parts:
        unknown = np.flatnonzero(~np.isin(codes[position], list(ALGORITHM_NAMES)))
        if len(unknown):
            row = int(rows[unknown[0]])
            raise ShardFormatError(f"{segments[k].path}: shard {segments[k].string('shard_path', row)!r} has checksum "
                                   f"algorithm code {int(codes[position][unknown[0]])}, this shardio knows 0 and 1")
    arrays["shard_algorithm"] = codes
    digest_width = 16 if bool(np.all(codes == _XXH3)) else 32
    for name in ("shard_digest", "shard_meta_digest"):
        arrays[name] = _digests(segments, name, shard_parts, codes, digest_width)
    if any(BUCKET_COLUMN in s.arrays for s in segments):  # a bucketed dataset's: carried (spec, "Buckets")
        buckets = np.zeros(shards, dtype="<u2")
        for k, position, rows in shard_parts:
            column = segments[k].arrays.get(BUCKET_COLUMN)
            if column is not None:
                buckets[position] = column[rows]
        arrays[BUCKET_COLUMN] = buckets
    widths = {s.arrays[OUTPUT_DIGEST_COLUMN].shape[1] for s in segments if OUTPUT_DIGEST_COLUMN in s.arrays}
    if widths:  # a version 6 dataset's output digests: carried row for row (spec, "Model outputs")
        if len(widths) > 1:
            raise ShardFormatError(f"segments {', '.join(s.path for s in segments)}: {OUTPUT_DIGEST_COLUMN} of "
                                   f"{sorted(widths)} outputs (a dataset has one list of outputs)")
        outputs = np.zeros((shards, widths.pop(), DIGEST_BYTES[XXH3_128]), dtype=np.uint8)
        for k, position, rows in shard_parts:
            column = segments[k].arrays.get(OUTPUT_DIGEST_COLUMN)
            if column is not None:
                outputs[position] = column[rows]
        arrays[OUTPUT_DIGEST_COLUMN] = outputs

    for table, parts, count in (("input_name", input_parts, inputs), ("input_etag", input_parts, inputs),
                                ("shard_path", shard_parts, shards), ("shard_meta_path", shard_parts, shards),
                                ("removed", removed_parts, removed_count)):
        offsets, blob = _take_strings(segments, table, parts, count)
        _check_utf8(segments, table, parts, offsets, blob)
        if table.startswith("shard_"):
            _check_shard_paths(segments, table, parts, offsets, blob)
        arrays[f"{table}_offsets"], arrays[f"{table}_blob"] = offsets, blob
    samples = int(arrays["shard_samples"].sum())
    return MergedSegment(segment_bytes(with_fence(arrays, fence)), shards, inputs, removed_count, samples)


def _check_columns(segment: SegmentColumns) -> None:
    """What ``SegmentColumns`` leaves to its users: the input columns and every string table's offsets."""
    arrays, path = segment.arrays, segment.path
    inputs, shards = segment.input_count, len(arrays["shard_samples"])
    for name in (*_INPUT_INTS, "input_listed", "input_etag_offsets", "input_etag_blob"):
        if name not in arrays:
            raise ShardFormatError(f"{path}: not a readable index segment (no member {name}.npy)")
    for name in (*_INPUT_INTS, "input_listed", "input_first_shard", *_SHARD_INTS, "shard_algorithm"):
        if arrays[name].dtype.kind not in "iu":
            raise ShardFormatError(f"{path}: {name} is {arrays[name].dtype}, not integers")
    for name in (*_INPUT_INTS, "input_listed"):
        if arrays[name].shape != (inputs,):
            raise ShardFormatError(f"{path}: {name} is {arrays[name].shape}, not ({inputs},)")
    for table, rows in (("input_name", inputs), ("input_etag", inputs), ("shard_path", shards),
                        ("shard_meta_path", shards), ("removed", None)):
        offsets, blob = arrays[f"{table}_offsets"], arrays[f"{table}_blob"]
        if (offsets.ndim != 1 or blob.ndim != 1 or offsets.dtype.kind not in "iu" or blob.dtype != np.uint8
                or len(offsets) == 0 or (rows is not None and len(offsets) != rows + 1) or offsets[0] != 0
                or offsets[-1] > len(blob) or np.any(np.diff(offsets) < 0)):
            raise ShardFormatError(f"{path}: string table {table} has offsets that do not index its blob"
                                   + ("" if rows is None else f" in {rows} rows"))


def _widest(segment: SegmentColumns, table: str) -> int:
    offsets = segment.arrays[f"{table}_offsets"]
    return int(np.diff(offsets).max()) if len(offsets) > 1 else 0


def _keys(segment: SegmentColumns, table: str, width: int) -> np.ndarray:
    """Each entry of ``table`` as a fixed-width ``S`` key that orders as its UTF-8 bytes and is unique."""
    offsets = segment.arrays[f"{table}_offsets"]
    return _row_keys(offsets, segment.arrays[f"{table}_blob"], np.arange(len(offsets) - 1), width)


def _row_keys(offsets: np.ndarray, blob: np.ndarray, rows: np.ndarray, width: int) -> np.ndarray:
    """Entries ``rows`` of a string table as ``S`` keys: the bytes zero-padded to ``width``, then the length
    big-endian (numpy compares ``S`` values as zero-padded bytes: with the length, "a" and "a\\0" differ
    and "a" sorts first, as in UTF-8 byte order). Built ``_CHUNK`` bytes at a time."""
    starts = offsets[rows]
    lengths = offsets[rows + 1] - starts
    out = np.zeros((len(rows), width + 8), dtype=np.uint8)
    for lo, hi in _chunks(lengths):
        n = lengths[lo:hi]
        at = np.repeat(np.arange(lo, hi), n)
        column = np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)
        out[at, column] = blob[starts[at] + column]
    out[:, width:] = lengths.astype(">u8").view(np.uint8).reshape(len(rows), 8)
    return out.view(f"S{width + 8}").reshape(len(rows))


def _chunks(lengths: np.ndarray) -> list[tuple[int, int]]:
    """``[lo, hi)`` ranges of rows, each of about ``_CHUNK`` bytes (or one longer row)."""
    if not len(lengths):
        return []
    ends = np.cumsum(lengths)
    cuts = np.unique(np.searchsorted(ends, np.arange(_CHUNK, int(ends[-1]), _CHUNK), side="right")).tolist()
    bounds = [0, *[c for c in cuts if 0 < c < len(lengths)], len(lengths)]
    return list(zip(bounds[:-1], bounds[1:]))


def _parts(source: np.ndarray, rows: np.ndarray, segments: int) -> _Parts:
    out = []
    for k in range(segments):
        position = np.flatnonzero(source == k)
        if len(position):
            out.append((k, position, rows[position]))
    return out


def _gather(segments: list[SegmentColumns], column: str, parts: _Parts, count: int, dtype: object) -> np.ndarray:
    if dtype is None:
        dtype = np.result_type(*[segments[k].arrays[column].dtype for k, _, _ in parts]) if parts else np.uint8
    out = np.empty(count, dtype=dtype)
    for k, position, rows in parts:
        out[position] = segments[k].arrays[column][rows]
    return out


def _in_path_order(segment: SegmentColumns, rows: np.ndarray) -> np.ndarray:
    """``rows`` (whole inputs' shard ranges, ascending) reordered so each input's shards are by path, as
    ``encode_segment`` sorts them; a segment written by it is in that order already (the spec's), so
    this is the check, and the sort is for a segment written by another hand."""
    if len(rows) < 2:
        return rows
    first = segment.arrays["input_first_shard"]
    owner = np.searchsorted(first, rows, side="right") - 1
    offsets, blob = segment.arrays["shard_path_offsets"], segment.arrays["shard_path_blob"]
    width = int((offsets[rows + 1] - offsets[rows]).max())
    step = max(2, _CHUNK // (width + 8))
    same = owner[1:] == owner[:-1]
    ordered = True
    for lo in range(0, len(rows) - 1, step - 1):  # windows overlapping by a row: every adjacent pair
        key = _row_keys(offsets, blob, rows[lo:lo + step], width)
        if np.any(same[lo:lo + step - 1] & (key[1:] < key[:-1])):
            ordered = False
            break
    if ordered:
        return rows
    key = _row_keys(offsets, blob, rows, width)
    block = np.concatenate([[0], np.cumsum(~same)])  # each input's rows, in their order in the output
    by_path = np.argsort(key, kind="stable")
    return rows[by_path[np.argsort(block[by_path], kind="stable")]]


def _digests(segments: list[SegmentColumns], column: str, parts: _Parts, codes: np.ndarray, width: int) -> np.ndarray:
    """Digest rows at ``width`` bytes: each row's algorithm's bytes, zeros after (``decode_segment`` keeps
    only those, ``encode_segment`` pads with zeros)."""
    out = np.zeros((len(codes), width), dtype=np.uint8)
    for k, position, rows in parts:
        source = segments[k].arrays[column]
        if source.shape[1] < width and np.any(codes[position] != _XXH3):
            row = int(rows[np.flatnonzero(codes[position] != _XXH3)[0]])
            raise ShardFormatError(f"{segments[k].path}: shard {segments[k].string('shard_path', row)!r} is "
                                   f"{ALGORITHM_NAMES[int(segments[k].arrays['shard_algorithm'][row])]} in a "
                                   f"{source.shape[1]}-byte {column} column (spec, \"Index\")")
        take = min(width, source.shape[1])
        out[position, :take] = source[rows, :take]
    if width > DIGEST_BYTES[XXH3_128]:
        out[codes == _XXH3, DIGEST_BYTES[XXH3_128]:] = 0
    return out


def _take_strings(segments: list[SegmentColumns], table: str, parts: _Parts, count: int,
                  ) -> tuple[np.ndarray, np.ndarray]:
    """Rows ``parts`` of string table ``table`` of each segment as one new table (offsets ``<i8``, blob)."""
    lengths = np.zeros(count, dtype=np.int64)
    for k, position, rows in parts:
        offsets = segments[k].arrays[f"{table}_offsets"]
        lengths[position] = offsets[rows + 1] - offsets[rows]
    offsets_out = np.zeros(count + 1, dtype="<i8")
    np.cumsum(lengths, out=offsets_out[1:])
    blob = np.empty(int(offsets_out[-1]), dtype=np.uint8)
    for k, position, rows in parts:
        offsets = segments[k].arrays[f"{table}_offsets"]
        _copy_ranges(segments[k].arrays[f"{table}_blob"], offsets[rows].astype(np.int64), blob,
                     offsets_out[position], lengths[position])
    return offsets_out, blob


def _copy_ranges(source: np.ndarray, source_starts: np.ndarray, out: np.ndarray, out_starts: np.ndarray,
                 lengths: np.ndarray) -> None:
    """``out[out_starts[i]:+lengths[i]] = source[source_starts[i]:+lengths[i]]`` for every i, without a
    Python step per range: ranges adjacent in both arrays are joined into runs; a run of ``_CHUNK`` bytes
    or more is one slice copy (at most bytes / ``_CHUNK`` of them), the rest are copied through index
    arrays built ``_CHUNK`` bytes at a time."""
    nonempty = lengths > 0
    source_starts, out_starts, lengths = source_starts[nonempty], out_starts[nonempty], lengths[nonempty]
    if not len(lengths):
        return
    joined = ((source_starts[1:] == source_starts[:-1] + lengths[:-1])
              & (out_starts[1:] == out_starts[:-1] + lengths[:-1]))
    heads = np.flatnonzero(np.concatenate([[True], ~joined]))
    source_starts, out_starts = source_starts[heads], out_starts[heads]
    lengths = np.add.reduceat(lengths, heads)
    long = lengths >= _CHUNK
    for a, b, n in zip(source_starts[long].tolist(), out_starts[long].tolist(), lengths[long].tolist()):
        out[b:b + n] = source[a:a + n]
    source_starts, out_starts, lengths = source_starts[~long], out_starts[~long], lengths[~long]
    for lo, hi in _chunks(lengths):
        n = lengths[lo:hi]
        before = np.cumsum(n) - n
        target = np.arange(int(n.sum()), dtype=np.int64) + np.repeat(out_starts[lo:hi] - before, n)
        out[target] = source[target + np.repeat(source_starts[lo:hi] - out_starts[lo:hi], n)]


def _source(parts: _Parts, at: int) -> tuple[int, int]:
    """The (segment, row) an output row came from."""
    for k, position, rows in parts:
        found = int(np.searchsorted(position, at))
        if found < len(position) and position[found] == at:
            return k, int(rows[found])
    raise AssertionError(at)


def _check_utf8(segments: list[SegmentColumns], table: str, parts: _Parts, offsets: np.ndarray,
                blob: np.ndarray) -> None:
    """Every row UTF-8 (``decode_segment`` decodes them): the blob decodes, in ``_CHUNK`` pieces, and no
    row starts inside a character."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    bad = -1
    view = memoryview(blob)
    try:
        for start in range(0, len(blob), _CHUNK):
            pending = len(decoder.getstate()[0])
            decoder.decode(view[start:start + _CHUNK], final=start + _CHUNK >= len(blob))
    except UnicodeDecodeError as e:
        bad = max(0, start - pending + e.start)
    if bad < 0:
        starts = offsets[:-1][np.diff(offsets) > 0]
        inside = np.flatnonzero((blob[starts] & 0xC0) == 0x80)
        if not len(inside):
            return
        bad = int(starts[inside[0]])
    k, row = _source(parts, int(np.searchsorted(offsets, bad, side="right")) - 1)
    raise ShardFormatError(f"{segments[k].path}: {table} row {row} is not UTF-8")


def _check_shard_paths(segments: list[SegmentColumns], table: str, parts: _Parts, offsets: np.ndarray,
                       blob: np.ndarray) -> None:
    """``check_dataset_path`` over a whole table: ``shards/`` then a name that is not empty, does not start
    with a dot and holds no ``/``, ``\\`` or NUL (its fast path, which its slow path never widens)."""
    if len(offsets) < 2:
        return
    starts, lengths = offsets[:-1], np.diff(offsets)
    good = lengths > len(_SHARD_PREFIX)
    if good.all():
        for j, byte in enumerate(_SHARD_PREFIX.tolist()):
            good &= blob[starts + j] == byte
        good &= blob[starts + len(_SHARD_PREFIX)] != ord(".")
        ends = offsets[1:]
        slashes = np.flatnonzero(blob == ord("/"))  # positions: 8 bytes per slash, not per byte
        good &= np.searchsorted(slashes, ends) - np.searchsorted(slashes, starts) == 1
        forbidden = np.flatnonzero((blob == ord("\\")) | (blob == 0))
        good &= np.searchsorted(forbidden, ends) == np.searchsorted(forbidden, starts)
    if good.all():
        return
    at = int(np.flatnonzero(~good)[0])
    k, row = _source(parts, at)
    check_dataset_path(segments[k].string(table, row), segments[k].path)
    raise AssertionError(f"{segments[k].path}: {table} row {row}")  # check_dataset_path raised
