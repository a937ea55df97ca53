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

import hashlib
import io
import mmap
import multiprocessing.context
import multiprocessing.reduction
import os
import struct
import weakref
import zipfile
from collections.abc import Iterator, Sequence
from typing import Any, overload

import numpy as np

from shardio.errors import ShardFormatError, ShardIntegrityError
from shardio.store.checksum import ALGORITHM_NAMES, DIGEST_BYTES
from shardio.format.entries import InputEntry, ShardEntry
from shardio.format.names import check_dataset_path

__all__ = ["SegmentColumns", "ShardTable", "check_listed_once", "check_segment", "fold_segments", "hashes_in",
           "shard_entry", "string_hashes"]

_LOCAL_HEADER = struct.Struct("<4s5H3I2H")  # a zip local file header, up to its name
_HASH_CHUNK = 1 << 22
_FNV_OFFSET = np.uint64(0xCBF29CE484222325)  # 64-bit FNV-1a
_FNV_PRIME = np.uint64(0x100000001B3)
_HASH_ROWS = 1 << 16  # strings hashed at a time: bounds the temporaries, keeps them in cache
_INPUT_COLUMNS = ("input_name_offsets", "input_name_blob", "input_first_shard", "removed_offsets", "removed_blob")
_BUCKET_COLUMN = "shard_bucket"  # a bucketed dataset's segments only (spec, "Buckets")
_SHARD_COLUMNS = ("shard_path_offsets", "shard_path_blob", "shard_meta_path_offsets", "shard_meta_path_blob",
                  "shard_samples", "shard_bytes", "shard_meta_bytes", "shard_algorithm", "shard_digest",
                  "shard_meta_digest")


class SegmentColumns:
    """One segment's arrays, views into its bytes (a read-only memory map of a local file, or the bytes
    an object store returned): nothing is copied until a column is gathered.

    A mapped segment keeps a descriptor of its file open (``fd``), so a process it is handed to reads the
    very file this one checked, even once retention has deleted it: the spec promises a trainer its
    generation's index for the whole epoch, and DataLoader workers started with ``spawn`` (as with CUDA)
    unpickle the dataset after the parent opened it, possibly after the run that committed it collected
    that generation."""

    def __init__(self, buffer: Any, path: str, fd: int | None = None) -> None:
        self._open(buffer, path)
        self._hold(fd)

    def _hold(self, fd: int | None) -> None:
        self.fd = fd
        if fd is not None:
            weakref.finalize(self, os.close, fd)

    def __getstate__(self) -> dict[str, Any]:
        """To a DataLoader worker: a mapped file, while a process is being started (``spawn`` or
        ``forkserver``), as its open descriptor, duplicated into the new process (``multiprocessing``'s
        ``DupFd``: the same file, no copy, its pages shared through the page cache); otherwise by its path
        (segments are immutable, and this process has checked its digest). Bytes as bytes."""
        if isinstance(self.buffer, mmap.mmap):
            if self.fd is not None and multiprocessing.context.get_spawning_popen() is not None:
                return {"path": self.path, "fd": multiprocessing.reduction.DupFd(self.fd)}
            return {"path": self.path}
        return {"path": self.path, "data": bytes(self.buffer)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        data, fd = state.get("data"), None
        if "fd" in state:
            fd = state["fd"].detach()
            data = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
        elif data is None:
            try:
                with open(state["path"], "rb") as f:
                    data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except FileNotFoundError as e:
                raise ShardIntegrityError(
                    f"{state['path']}: index segment deleted since this index was opened (retention collected its "
                    "generation); a DataLoader worker gets it by descriptor, not by path: reopen the dataset "
                    "for its current generation") from e
        self._open(data, state["path"])
        self._hold(fd)

    def _open(self, buffer: Any, path: str) -> None:
        self.path = path
        self.buffer = buffer
        self.arrays: dict[str, np.ndarray] = {}
        try:
            with zipfile.ZipFile(_Reader(buffer)) as archive:
                members = archive.infolist()
            for info in members:
                self.arrays[info.filename.removesuffix(".npy")] = self._member(info)
        except (ValueError, KeyError, OSError, struct.error, zipfile.BadZipFile) as e:
            raise ShardFormatError(f"{path}: not a readable index segment ({type(e).__name__}: {e})") from e
        missing = [name for name in _INPUT_COLUMNS + _SHARD_COLUMNS if name not in self.arrays]
        if missing:
            raise ShardFormatError(f"{path}: not a readable index segment (no member {missing[0]}.npy)")
        first = self.arrays["input_first_shard"]
        shards = len(self.arrays["shard_samples"])
        if (len(first) != self.input_count + 1 or (len(first) and (first[0] != 0 or first[-1] != shards))
                or np.any(np.diff(first) < 0)):
            raise ShardFormatError(f"{path}: input_first_shard does not partition its {shards} shards")
        for name in _SHARD_COLUMNS:
            if not name.endswith(("_offsets", "_blob")) and len(self.arrays[name]) != shards:
                raise ShardFormatError(f"{path}: {name} has {len(self.arrays[name])} rows, not {shards}")
        bucket = self.arrays.get(_BUCKET_COLUMN)
        if bucket is not None and (bucket.shape != (shards,) or bucket.dtype.kind not in "iu"):
            raise ShardFormatError(f"{path}: {_BUCKET_COLUMN} is {bucket.dtype} {bucket.shape}, not ({shards},) "
                                   "integers")
        for name in ("shard_digest", "shard_meta_digest"):
            if self.arrays[name].ndim != 2 or self.arrays[name].shape[1] not in (16, 32):
                raise ShardFormatError(f"{path}: {name} is {self.arrays[name].shape}, not ({shards}, 16 or 32)")

    def _member(self, info: zipfile.ZipInfo) -> np.ndarray:
        if info.compress_type != zipfile.ZIP_STORED:
            raise ValueError(f"member {info.filename} is compressed (a segment's members are stored)")
        header = _LOCAL_HEADER.unpack_from(self.buffer, info.header_offset)
        if header[0] != b"PK\x03\x04":
            raise ValueError(f"member {info.filename}: no local header at {info.header_offset}")
        start = info.header_offset + _LOCAL_HEADER.size + header[9] + header[10]
        stream = io.BytesIO(bytes(memoryview(self.buffer)[start:start + min(info.file_size, 4096)]))
        version = np.lib.format.read_magic(stream)
        read_header = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}
        if version not in read_header:
            raise ValueError(f"member {info.filename}: .npy version {version}")
        shape, fortran, dtype = read_header[version](stream, max_header_size=4096)
        if dtype.hasobject or fortran:
            raise ValueError(f"member {info.filename}: dtype {dtype} / fortran order (a segment holds plain arrays)")
        count = int(np.prod(shape))
        offset = start + stream.tell()
        if offset + count * dtype.itemsize > start + info.file_size:
            raise ValueError(f"member {info.filename}: its header claims more bytes than it holds")
        return np.frombuffer(self.buffer, dtype=dtype, count=count, offset=offset).reshape(shape)

    @property
    def input_count(self) -> int:
        return len(self.arrays["input_name_offsets"]) - 1

    def names(self, table: str) -> np.ndarray:
        """String table ``table`` as a fixed-width bytes array (``S``), built without a Python loop (numpy
        orders ``S`` values as the spec's UTF-8 byte order)."""
        offsets, blob = self.arrays[f"{table}_offsets"], self.arrays[f"{table}_blob"]
        if offsets.ndim != 1 or len(offsets) == 0 or offsets[0] != 0 or offsets[-1] > len(blob) or np.any(
                np.diff(offsets) < 0):
            raise ShardFormatError(f"{self.path}: string table {table} has offsets that do not index its blob")
        return _fixed_width(offsets, blob)

    def strings(self, table: str, rows: np.ndarray) -> list[str]:
        """Entries ``rows`` of string table ``table``: the blob decoded once (an ASCII one sliced as text),
        not one decode per row (230k input names: 1.2 s one by one)."""
        offsets, blob = self.arrays[f"{table}_offsets"], self.arrays[f"{table}_blob"]
        starts, stops = offsets[rows], offsets[np.asarray(rows) + 1]
        if len(rows) and (starts.min() < 0 or np.any(stops < starts) or stops.max() > len(blob)):
            raise ShardFormatError(f"{self.path}: string table {table} has offsets outside its {len(blob)}-byte blob")
        if not len(blob) or not len(rows):
            return [""] * len(rows)
        data = blob.tobytes()
        if int(blob.max()) < 128:
            text = data.decode("ascii")
            return [text[a:b] for a, b in zip(starts.tolist(), stops.tolist())]
        return [self.string(table, int(row)) for row in rows]

    def hashes(self, table: str, rows: np.ndarray | None = None) -> np.ndarray:
        """``string_hashes`` of entries ``rows`` (None: every entry) of string table ``table``, straight from
        its offsets and blob: no string, no fixed-width copy."""
        offsets, blob = self.arrays[f"{table}_offsets"], self.arrays[f"{table}_blob"]
        if offsets.ndim != 1 or len(offsets) == 0:
            raise ShardFormatError(f"{self.path}: string table {table} has no offsets")
        if rows is None:
            starts, stops = offsets[:-1], offsets[1:]
        else:
            starts, stops = offsets[rows], offsets[np.asarray(rows) + 1]
        if len(starts) and (starts.min() < 0 or np.any(stops < starts) or stops.max() > len(blob)):
            raise ShardFormatError(f"{self.path}: string table {table} has offsets outside its {len(blob)}-byte blob")
        return _fnv1a(blob, np.asarray(starts, np.int64), np.asarray(stops - starts, np.int64))

    def string(self, table: str, row: int) -> str:
        """Entry ``row`` of string table ``table`` (its offsets checked here, when read: a table is not
        scanned whole to open the index)."""
        offsets, blob = self.arrays[f"{table}_offsets"], self.arrays[f"{table}_blob"]
        start, stop = int(offsets[row]), int(offsets[row + 1])
        if not 0 <= start <= stop <= len(blob):
            raise ShardFormatError(f"{self.path}: string table {table} row {row} has offsets {start}..{stop} outside "
                                   f"its {len(blob)}-byte blob")
        try:
            return blob[start:stop].tobytes().decode("utf-8")
        except UnicodeDecodeError as e:
            raise ShardFormatError(f"{self.path}: {table} row {row} is not UTF-8 ({e.reason})") from e


class _Reader(io.RawIOBase):
    """A seekable read-only file over a buffer, so ``zipfile`` reads the central directory without a copy."""

    def __init__(self, buffer: Any) -> None:
        self.view, self.position = memoryview(buffer), 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        self.position = {0: 0, 1: self.position, 2: len(self.view)}[whence] + offset
        return self.position

    def tell(self) -> int:
        return self.position

    def readinto(self, out: Any) -> int:
        chunk = self.view[self.position:self.position + len(out)]
        out[:len(chunk)] = chunk
        self.position += len(chunk)
        return len(chunk)


def _fixed_width(offsets: np.ndarray, blob: np.ndarray) -> np.ndarray:
    """The strings as one ``S`` array, filled a byte column at a time: the temporaries are a few bytes
    per string, not per byte (an index per blob byte cost 16x the blob: 220 MB for 230k input names)."""
    lengths = np.diff(offsets)
    count = len(lengths)
    longest = int(lengths.max()) if count else 0
    width = max(1, longest)
    if count and offsets[-1] == count * longest and offsets[0] == 0 and bool(np.all(lengths == longest)):
        out = np.array(blob[:count * longest]).reshape(count, longest)  # every string as long: one copy
        return out.view(f"S{width}").reshape(count)
    out = np.zeros((count, width), dtype=np.uint8)
    starts = offsets[:-1]
    for column in range(longest):
        rows = np.flatnonzero(lengths > column)
        out[rows, column] = blob[starts[rows] + column]
    return out.view(f"S{width}").reshape(count)


def string_hashes(values: Sequence[str] | np.ndarray) -> np.ndarray:
    """The 64-bit FNV-1a hash of each value's UTF-8 bytes (uint64, in order): a ``str`` sequence (a name
    that is not UTF-8, as ``os.listdir`` gives it, hashes as its bytes: ``surrogateescape``), or a
    fixed-width ``S`` array, whose values hash without their NUL padding (the same at any width).
    Computed a byte column at a time over all the strings, with numpy's uint64 wrap-around: no Python
    object per string for an array. For membership: equal strings hash equal; unequal ones may too (about
    n*m/2**64 expected collisions of m names against n), so a match means "maybe listed"."""
    if isinstance(values, np.ndarray) and values.dtype.kind == "S":
        flat = np.ascontiguousarray(values).reshape(-1)
        width = flat.dtype.itemsize
        if not len(flat) or not width:
            return np.full(len(flat), _FNV_OFFSET, dtype=np.uint64)
        matrix = flat.view(np.uint8).reshape(len(flat), width)
        lengths = np.empty(len(flat), dtype=np.int64)
        for start in range(0, len(flat), _HASH_ROWS):  # a value ends at its last non-NUL byte
            nonzero = matrix[start:start + _HASH_ROWS] != 0
            last = width - np.argmax(nonzero[:, ::-1], axis=1)
            lengths[start:start + _HASH_ROWS] = np.where(nonzero.any(axis=1), last, 0)
        return _fnv1a(matrix.reshape(-1), np.arange(len(flat), dtype=np.int64) * width, lengths)
    encoded = [value.encode("utf-8", "surrogateescape") for value in values]
    lengths = np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded))
    starts = np.zeros(len(encoded), dtype=np.int64)
    np.cumsum(lengths[:-1], out=starts[1:])
    return _fnv1a(np.frombuffer(b"".join(encoded), dtype=np.uint8), starts, lengths)


def hashes_in(listed: np.ndarray, hashes: np.ndarray) -> np.ndarray:
    """A bool per hash: is it in ``listed`` (sorted uint64, as ``ShardTable.path_hashes`` gives)? A binary
    search per hash, so a chunk of names costs O(chunk log listed), not a sort of both."""
    if not len(listed) or not len(hashes):
        return np.zeros(len(hashes), dtype=bool)
    at = np.searchsorted(listed, hashes)
    at[at == len(listed)] = 0
    return listed[at] == hashes


def _fnv1a(blob: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """FNV-1a of the byte strings ``blob[starts[i]:starts[i] + lengths[i]]``. Rows in blocks, each block
    ordered longest first, so byte column ``j`` is a prefix of the block (the rows longer than ``j``)."""
    out = np.empty(len(starts), dtype=np.uint64)
    for start in range(0, len(starts), _HASH_ROWS):
        block_lengths = lengths[start:start + _HASH_ROWS]
        order = np.argsort(-block_lengths, kind="stable")
        ordered_starts = starts[start:start + _HASH_ROWS][order]
        longer = np.sort(block_lengths)  # longer[j]: how many rows are longer than j, from the top
        state = np.full(len(order), _FNV_OFFSET, dtype=np.uint64)
        width = int(longer[-1]) if len(longer) else 0
        for j in range(width):
            active = len(longer) - int(np.searchsorted(longer, j, side="right"))
            part = state[:active]
            part ^= blob[ordered_starts[:active] + j]
            part *= _FNV_PRIME
        out[start:start + len(order)][order] = state
    return out


def map_segment(path: str, expected_bytes: int, expected_name: str) -> SegmentColumns:
    """A local segment, memory-mapped, after checking its size and its sha256 (streamed in 4 MB reads, so
    the check does not make the whole file resident in this process)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        digest = hashlib.sha256()
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
        _check(path, size, digest.hexdigest(), expected_bytes, expected_name)
        if not size:
            return SegmentColumns(b"", path)
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        return SegmentColumns(mapped, path, os.dup(f.fileno()))  # the checked file, for worker processes


def segment_from_bytes(data: bytes, path: str, expected_bytes: int, expected_name: str) -> SegmentColumns:
    """A segment read whole (object storage), after the same checks."""
    _check(path, len(data), hashlib.sha256(data).hexdigest(), expected_bytes, expected_name)
    return SegmentColumns(data, path)


def check_segment(path: str, size: int, digest: str, expected_bytes: int, expected_name: str) -> None:
    """``ShardIntegrityError`` unless the segment's size and sha256 are the root's."""
    _check(path, size, digest, expected_bytes, expected_name)


def _check(path: str, size: int, digest: str, expected_bytes: int, expected_name: str) -> None:
    if size != expected_bytes or digest != expected_name:
        raise ShardIntegrityError(f"{path}: {size} bytes with sha256 {digest}; the root says {expected_bytes} bytes "
                                  f"and sha256 {expected_name} (corrupt or truncated): HINT: `preprocess verify DIR "
                                  "--repair` restores a kept generation")


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
        if not any(_BUCKET_COLUMN in s.arrays for s in self.segments):
            return np.zeros(len(self), dtype=np.int64)
        if self.sources is None:
            return np.asarray(self.segments[0].arrays[_BUCKET_COLUMN], dtype=np.int64)
        out = np.zeros(len(self), dtype=np.int64)
        for k, segment in enumerate(self.segments):
            if _BUCKET_COLUMN in segment.arrays:
                mine = self.sources == k
                out[mine] = segment.arrays[_BUCKET_COLUMN][self.rows[mine]]
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

    def path_hashes(self) -> np.ndarray:
        """The sorted, distinct ``string_hashes`` of the live shards' paths and meta paths: what a check of
        which files under ``shards/`` are listed needs (~16 bytes a shard while it runs, 8 after), with no
        Python object per shard (a table over entries hashes their paths)."""
        if self._entries is not None:
            return np.unique(string_hashes([p for e in self._entries for p in (e.path, e.meta_path)]))
        parts = []
        for k, segment in enumerate(self.segments):
            rows = None if self.sources is None else self.rows[self.sources == k]
            if rows is not None and not len(rows):
                continue
            parts += [segment.hashes("shard_path", rows), segment.hashes("shard_meta_path", rows)]
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
    bucket = int(arrays[_BUCKET_COLUMN][row]) if _BUCKET_COLUMN in arrays else 0
    return ShardEntry(path, meta, int(arrays["shard_samples"][row]), int(arrays["shard_bytes"][row]),
                      arrays["shard_digest"][row, :size].tobytes().hex(), int(arrays["shard_meta_bytes"][row]),
                      arrays["shard_meta_digest"][row, :size].tobytes().hex(), segment.string("input_name", owner),
                      algorithm, bucket)


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
