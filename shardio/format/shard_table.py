"""A generation's shards as columns: what a reader needs of format 3's index without a Python object per shard.

``load_manifest`` builds a ``Manifest`` (an entry object per shard and per input: what a commit edits).
That costs ~10 µs and ~1 KB a shard: 25 s and 2 GB at LAION-2B's 2.3M shards, paid by every rank and
worker. A reader needs the sample counts of every shard and, for the shards it touches, their paths
and sizes; so this module maps each segment's members where they lie in the file (the segment is an
uncompressed zip: the spec's "Index"), folds the segments with numpy over their input-name columns,
and gives a ``ShardTable``: the live shards in dataset order as a few arrays (~30 bytes a shard), whose
``table[i]`` makes the ``ShardEntry`` of shard ``i`` when it is asked for. Numpy and the standard
library only.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import overload

import numpy as np

from shardio.errors import ShardFormatError
from shardio.store.checksum import ALGORITHM_NAMES, DIGEST_BYTES
from shardio.format.entries import InputEntry, ShardEntry
from shardio.format.model_outputs import OUTPUT_DIGEST_COLUMN, output_path, shard_files
from shardio.format.names import check_dataset_path
from shardio.format.segment_columns import BUCKET_COLUMN, SegmentColumns
from shardio.format.string_hashes import string_hashes

__all__ = ["ShardTable", "check_listed_once", "fold_segments", "shard_entry"]

class ShardTable(Sequence[ShardEntry]):
    """The live shards of one generation in dataset order: ``samples`` (int64 per shard) for the plan,
    and ``table[i]`` (a ``ShardEntry``, its paths checked) for a shard being opened.

    Each shard is row ``rows[i]`` of segment ``sources[i]``; ``None`` for both: shard ``i`` is row ``i``
    of the one segment (a compacted index: no per-shard array beyond ``samples``)."""

    def __init__(self, segments: list[SegmentColumns], sources: np.ndarray | None, rows: np.ndarray | None,
                 samples: np.ndarray, where: str, live_inputs: list[tuple[int, np.ndarray]] | None = None) -> None:
        self.segments, self.sources, self.rows = segments, sources, rows
        self.samples = samples
        self.where = where
        # (segment, its live input rows) per segment; None: every input of the one segment
        self.live_inputs = live_inputs
        self._entries: list[ShardEntry] | None = None
        self._input_names: list[str] | None = None

    @classmethod
    def from_entries(cls, entries: Sequence[ShardEntry], where: str = "manifest") -> ShardTable:
        """A table over entry objects (a version 1/2 manifest, or one built in memory)."""
        table = cls([], None, None, np.array([e.samples for e in entries], dtype=np.int64), where)
        table._entries = list(entries)
        return table

    def committed_inputs(self) -> dict[str, InputEntry]:
        """The listed live inputs as entries (``shards`` left empty): one per input, none per shard."""
        if self._entries is not None:
            raise TypeError("committed_inputs() is for a table over segments; a version 1/2 manifest has "
                            "its inputs in load_manifest")
        out: dict[str, InputEntry] = {}
        live = self.live_inputs or [(k, np.arange(s.input_count)) for k, s in enumerate(self.segments)]
        for k, rows in live:
            segment = self.segments[k]
            arrays = segment.arrays
            if "input_listed" in arrays:
                rows = rows[arrays["input_listed"][rows] != 0]
            columns = [arrays[f"input_{name}"][rows].tolist() for name in ("size", "mtime_ns", "samples", "failed")]
            names, etags = segment.strings("input_name", rows), segment.strings("input_etag", rows)
            for position, name in enumerate(names):
                out[name] = InputEntry(columns[0][position], columns[1][position], columns[2][position],
                                       columns[3][position], [], etags[position])
        return out

    def input_names(self) -> list[str]:
        """The committed inputs' names (``shardio info`` counts their failures): O(inputs), asked for once."""
        if self._input_names is None:
            if self._entries is not None:
                self._input_names = sorted({e.input for e in self._entries})
            else:
                self._input_names = list(self.committed_inputs())
        return self._input_names

    def __len__(self) -> int:
        return len(self.samples)

    @overload
    def __getitem__(self, index: int) -> ShardEntry: ...

    @overload
    def __getitem__(self, index: slice) -> list[ShardEntry]: ...

    def __getitem__(self, index: int | slice) -> ShardEntry | list[ShardEntry]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if self._entries is not None:
            return self._entries[index]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"shard {index} of {len(self)}")
        segment = self.segments[0 if self.sources is None else int(self.sources[index])]
        row = index if self.rows is None else int(self.rows[index])
        return shard_entry(segment, row)

    def __iter__(self) -> Iterator[ShardEntry]:
        return (self[i] for i in range(len(self)))

    def column(self, name: str) -> np.ndarray:
        """Column ``name`` (``bytes``, ``meta_bytes``, ``samples``, ``bucket``) of every shard, in dataset order."""
        if name == "samples":
            return self.samples
        if name == "bucket":
            return self.bucket_ids()
        if self._entries is not None:
            return np.array([getattr(e, name) for e in self._entries], dtype=np.int64)
        return self._gather(f"shard_{name}")

    def bucket_ids(self) -> np.ndarray:
        """Each shard's bucket id (int64, dataset order) from the segments' ``shard_bucket`` columns: zeros
        for a single-shape dataset, whose segments have none (spec, "Buckets"); no object per shard."""
        if self._entries is not None:
            return np.array([e.bucket for e in self._entries], dtype=np.int64)
        if not any(BUCKET_COLUMN in s.arrays for s in self.segments):
            return np.zeros(len(self), dtype=np.int64)
        if self.sources is None:
            return np.asarray(self.segments[0].arrays[BUCKET_COLUMN], dtype=np.int64)
        out = np.zeros(len(self), dtype=np.int64)
        for k, segment in enumerate(self.segments):
            if BUCKET_COLUMN in segment.arrays:
                mine = self.sources == k
                out[mine] = segment.arrays[BUCKET_COLUMN][self.rows[mine]]
        return out

    def checksum_algorithms(self) -> set[str]:
        """The checksum algorithms the shards name, by a count over the codes (no entry made); a code this
        shardio does not know is left out here and refused when its shard's entry is made."""
        if self._entries is not None:
            return {e.checksum_algorithm for e in self._entries}
        if self.sources is None:  # one segment: its uint8 column as it lies, no int64 copy
            codes = self.segments[0].arrays["shard_algorithm"] if self.segments else np.zeros(0, np.uint8)
        else:
            codes = self._gather("shard_algorithm")
        return {name for code, name in ALGORITHM_NAMES.items() if (codes == code).any()}

    def path_hashes(self, output_names: Sequence[str] = ()) -> np.ndarray:
        """The sorted, distinct ``string_hashes`` of the live shards' paths and meta paths (and of their output
        files, ``output_names`` the root's outputs): what a check of which files under ``shards/`` are listed
        needs (~16 bytes a shard while it runs, 8 after), with no Python object per shard (a table over entries
        hashes their paths; an output file's path is made from its shard's, a string a shard)."""
        if self._entries is not None:
            return np.unique(string_hashes([p for e in self._entries
                                            for p in shard_files(e.path, e.meta_path, output_names)]))
        parts = []
        for k, segment in enumerate(self.segments):
            rows = None if self.sources is None else self.rows[self.sources == k]
            if rows is not None and not len(rows):
                continue
            parts += [segment.hashes("shard_path", rows), segment.hashes("shard_meta_path", rows)]
            if output_names:
                paths = [segment.string("shard_path", int(r))
                         for r in (range(len(segment.arrays["shard_samples"])) if rows is None else rows)]
                parts += [string_hashes([output_path(p, name) for p in paths]) for name in output_names]
        return np.unique(np.concatenate(parts)) if parts else np.zeros(0, dtype=np.uint64)

    def _gather(self, column: str) -> np.ndarray:
        if self.sources is None:
            if not self.segments:
                return np.zeros(0, np.int64)
            return np.asarray(self.segments[0].arrays[column], dtype=np.int64)
        out = np.empty(len(self), dtype=np.int64)
        for k, segment in enumerate(self.segments):
            mine = self.sources == k
            out[mine] = segment.arrays[column][self.rows[mine]]
        return out


def shard_entry(segment: SegmentColumns, row: int) -> ShardEntry:
    """Shard row ``row`` of ``segment`` as an entry (its paths and checksum algorithm checked)."""
    arrays = segment.arrays
    code = int(arrays["shard_algorithm"][row])
    algorithm = ALGORITHM_NAMES.get(code)
    if algorithm is None:
        raise ShardFormatError(f"{segment.path}: shard row {row} has checksum algorithm code {code}, this shardio "
                               "knows 0 and 1")
    size = DIGEST_BYTES[algorithm]
    path = check_dataset_path(segment.string("shard_path", row), segment.path)
    meta = check_dataset_path(segment.string("shard_meta_path", row), segment.path)
    first = arrays["input_first_shard"]
    owner = int(np.searchsorted(first, row, side="right")) - 1
    bucket = int(arrays[BUCKET_COLUMN][row]) if BUCKET_COLUMN in arrays else 0
    column = arrays.get(OUTPUT_DIGEST_COLUMN)
    outputs = () if column is None else tuple(digest.tobytes().hex() for digest in column[row])
    return ShardEntry(path, meta, int(arrays["shard_samples"][row]), int(arrays["shard_bytes"][row]),
                      arrays["shard_digest"][row, :size].tobytes().hex(), int(arrays["shard_meta_bytes"][row]),
                      arrays["shard_meta_digest"][row, :size].tobytes().hex(), segment.string("input_name", owner),
                      algorithm, bucket, outputs)


def fold_segments(segments: list[SegmentColumns], where: str) -> ShardTable:
    """The live shards after folding ``segments`` (oldest first) as the spec's "Meaning" says: an input
    lives in the newest segment naming it (as an input or a removal), and not at all if that one removes
    it; inputs in name order, each one's shards in its segment's order (by path). A shard file listed
    twice (under two live inputs, or twice by one) is a ShardFormatError naming ``where`` and the file."""
    table = _fold(segments, where)
    check_listed_once(table)
    return table


def check_listed_once(table: ShardTable) -> None:
    """ShardFormatError naming the root (``table.where``) when a shard file is listed twice among the live
    shards (its samples would be read twice, and a repair or prune would act on it twice), as a version
    1/2 manifest's load refuses it. Each path hashed from its segment's blob (``SegmentColumns.hashes``:
    no string per shard) and the hashes sorted, so a duplicate is a neighbour; only hashes that repeat
    are read back as strings, to tell a duplicate from a collision."""
    if table._entries is not None or len(table) < 2:
        return  # a table over entries: its manifest's load checked them (``Manifest.from_json``)
    for column in ("shard_path", "shard_meta_path"):
        if table.sources is None:
            hashes = table.segments[0].hashes(column)
        else:
            hashes = np.empty(len(table), dtype=np.uint64)
            for k, segment in enumerate(table.segments):
                mine = table.sources == k
                if mine.any():
                    hashes[mine] = segment.hashes(column, table.rows[mine])
        ordered = np.sort(hashes)
        repeated = ordered[1:][ordered[1:] == ordered[:-1]]
        if not len(repeated):
            continue
        seen: dict[str, int] = {}
        for position in np.flatnonzero(np.isin(hashes, repeated)).tolist():
            entry = table[position]
            rel = entry.path if column == "shard_path" else entry.meta_path
            if rel in seen:
                first = table[seen[rel]]
                owners = (f"twice by input {entry.input!r}" if first.input == entry.input
                          else f"by inputs {first.input!r} and {entry.input!r}")
                raise ShardFormatError(
                    f"{table.where}: shard file {rel!r} is listed {owners} (in "
                    f"{_segments_of(table, seen[rel], position)}"
                    "; an index lists each shard file once: edited or forged?): nothing was read")
            seen[rel] = position


def _segments_of(table: ShardTable, *positions: int) -> str:
    paths = [table.segments[0 if table.sources is None else int(table.sources[p])].path for p in positions]
    names = list(dict.fromkeys(paths))
    return f"segment {names[0]}" if len(names) == 1 else f"segments {' and '.join(names)}"


def _fold(segments: list[SegmentColumns], where: str) -> ShardTable:
    if not segments:
        return ShardTable([], None, None, np.zeros(0, np.int64), where)
    if len(segments) == 1:
        return ShardTable(segments, None, None, np.asarray(segments[0].arrays["shard_samples"], np.int64), where)
    later = np.zeros(0, dtype="S1")  # names a newer segment decides
    keep: list[np.ndarray] = []
    names: list[np.ndarray] = []
    for segment in reversed(segments):
        own = segment.names("input_name")
        keep.append(~np.isin(own, later) if len(later) else np.ones(len(own), bool))
        names.append(own)
        later = np.concatenate([later, own, segment.names("removed")])
    keep.reverse()
    names.reverse()
    live_names, live_segment, live_input = [], [], []
    for k, (own, mask) in enumerate(zip(names, keep)):
        index = np.flatnonzero(mask)
        live_names.append(own[index])
        live_segment.append(np.full(len(index), k, dtype=np.int64))
        live_input.append(index)
    order = np.argsort(np.concatenate(live_names), kind="stable")
    input_segment = np.concatenate(live_segment)[order]
    input_row = np.concatenate(live_input)[order]
    starts = np.empty(len(order), dtype=np.int64)
    counts = np.empty(len(order), dtype=np.int64)
    for k, segment in enumerate(segments):
        mine = input_segment == k
        first = segment.arrays["input_first_shard"]
        starts[mine] = first[input_row[mine]]
        counts[mine] = first[input_row[mine] + 1] - first[input_row[mine]]
    total = int(counts.sum())
    sources = np.repeat(input_segment, counts).astype(np.uint16 if len(segments) < 65536 else np.int64)
    ends = np.cumsum(counts)
    rows = np.arange(total, dtype=np.int64) - np.repeat(ends - counts - starts, counts)
    samples = np.empty(total, dtype=np.int64)
    for k, segment in enumerate(segments):
        mine = sources == k
        samples[mine] = segment.arrays["shard_samples"][rows[mine]]
    if total < 2**31:
        rows = rows.astype(np.int32)
    return ShardTable(segments, sources, rows, samples, where,
                      [(k, np.flatnonzero(mask)) for k, mask in enumerate(keep)])
