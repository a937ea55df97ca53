"""One index segment as columns: its members memory-mapped where they lie in the file (a segment is an
uncompressed zip: the spec's "Index"), checked by size and sha256 against the root before use, and handed to
spawned worker processes as its open descriptor. ``shardio.format.shard_table`` folds segments into a
generation's ``ShardTable``."""

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
from typing import Any

import numpy as np

from shardio.errors import ShardFormatError, ShardIntegrityError
from shardio.format.model_outputs import OUTPUT_DIGEST_COLUMN, check_output_digests
from shardio.format.raw_shard import npy_header_dict
from shardio.format.string_hashes import fnv1a

__all__ = ["SegmentColumns", "BUCKET_COLUMN", "map_segment", "segment_from_bytes", "check_segment"]

_LOCAL_HEADER = struct.Struct("<4s5H3I2H")  # a zip local file header, up to its name
_HASH_CHUNK = 1 << 22
_INPUT_COLUMNS = ("input_name_offsets", "input_name_blob", "input_first_shard", "removed_offsets", "removed_blob")
BUCKET_COLUMN = "shard_bucket"  # a bucketed dataset's segments only (spec, "Buckets")
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
        bucket = self.arrays.get(BUCKET_COLUMN)
        if bucket is not None and (bucket.shape != (shards,) or bucket.dtype.kind not in "iu"):
            raise ShardFormatError(f"{path}: {BUCKET_COLUMN} is {bucket.dtype} {bucket.shape}, not ({shards},) "
                                   "integers")
        check_output_digests(self.arrays.get(OUTPUT_DIGEST_COLUMN), shards, path)
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
        shape, dtype = read_npy_header(stream, info.filename)
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
        return fnv1a(blob, np.asarray(starts, np.int64), np.asarray(stops - starts, np.int64))

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


def read_npy_header(stream: io.BytesIO, name: str) -> tuple[tuple[int, ...], np.ndarray]:
    """(shape, dtype) of the .npy member ``name`` whose bytes ``stream`` starts at, left at its data: a plain
    C-order array of version 1.0 or 2.0. The header is read without ``ast`` (``npy_header_dict`` says why);
    ValueError naming the member otherwise."""
    version = np.lib.format.read_magic(stream)
    if version not in ((1, 0), (2, 0)):
        raise ValueError(f"member {name}: .npy version {version}")
    size = struct.unpack("<H" if version == (1, 0) else "<I", stream.read(2 if version == (1, 0) else 4))[0]
    if size > 4096:
        raise ValueError(f"member {name}: a header of {size} bytes")
    try:
        meta = npy_header_dict(stream.read(size).decode("latin1"))
        dtype = np.dtype(meta["descr"])
    except (ValueError, TypeError) as e:
        raise ValueError(f"member {name}: {e}") from e
    if dtype.hasobject or meta["fortran_order"]:
        raise ValueError(f"member {name}: dtype {dtype} / fortran order (a segment holds plain arrays)")
    return meta["shape"], dtype


def npz_arrays(data: bytes) -> dict[str, np.ndarray]:
    """Every member of an ``.npz`` (stored or deflated), by name without ``.npy``, as a read-only array; what
    ``np.load`` gives, without its ``ast`` header parse (``read_npy_header``)."""
    arrays: dict[str, np.ndarray] = {}
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        for info in archive.infolist():
            raw = archive.read(info)
            stream = io.BytesIO(raw)
            shape, dtype = read_npy_header(stream, info.filename)
            count = int(np.prod(shape))
            if stream.tell() + count * dtype.itemsize > len(raw):
                raise ValueError(f"member {info.filename}: its header claims more bytes than it holds")
            arrays[info.filename.removesuffix(".npy")] = np.frombuffer(raw, dtype, count, stream.tell()).reshape(shape)
    return arrays
