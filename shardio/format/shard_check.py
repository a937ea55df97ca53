"""The one shard checker: what is wrong with a listed shard, from the sizes the format implies (O(1)) or
also its checksums and its header (reads every byte). The reader checks sizes on open, ``verify`` checksums
and headers, a corrupt manifest's restore all three; it lives with the format, not the write side, so the
reader imports no writer.

The header check is what sizes and checksums cannot see: a shard whose bytes are the ones the writer wrote
(its checksum matches) but whose index row lists it at another shape. An 8x16 bucket and a 16x8 one have
the same raw sizes, and a JPEG shard's size says nothing of its images' size, so an index whose
``shard_bucket`` was edited passes both. A raw shard's ``.npy`` header (128 bytes) and a JPEG shard's first
image's frame header (its SOF: the header, the offsets and that image read) must say the listed count and
the shard's bucket's h x w; a yuv420 shard's header says the count and the bytes a sample (S, which two
shapes may share: 8x16 and 16x8 both take 192), checked against the bucket's."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext

import numpy as np

from shardio.errors import ShardFormatError
from shardio.format.jpeg_shard import jpeg_data_start, jpeg_frame_size, parse_jpeg_header
from shardio.format.manifests import DatasetIndex
from shardio.format.string_hashes import string_hashes
from shardio.format.dataset_manifest import Manifest
from shardio.format.entries import ShardEntry, expected_shard_size
from shardio.format.model_outputs import OutputSpec, output_header, output_nbytes, output_path, parse_output_header
from shardio.format.raw_shard import parse_npy_header
from shardio.format.spec import HEADER_BYTES, NONE, RAW, SHARDS_DIR, YUV420
from shardio.format.yuv_shard import parse_yuv_header, yuv_sample_bytes
from shardio.store.root import DatasetRoot
from shardio.store.base import FileInfo, Storage
from shardio.store.checksum import XXH3_128

__all__ = ["ListedSizes", "shard_problem", "shard_problems"]


class ListedSizes:
    """``path -> size`` of the files an object-store listing found, built one LIST page at a time into two
    numpy arrays (the path's 64-bit hash, sorted, and the size: 16 bytes a file, ~75 MB for LAION-2B-en's
    4.6M shard files, about a tenth of a dict of their URLs). ``KeyError`` for a path not listed. Two paths
    whose hashes collide (about n**2 / 2**65: 6e-7 at 4.6M files) would lend one the other's size: at
    worst one false "truncated" report, never a missed problem of a file whose size differs from both."""

    def __init__(self, pages: Iterable[list[FileInfo]]) -> None:
        hashes, sizes = [np.zeros(0, np.uint64)], [np.zeros(0, np.int64)]
        for page in pages:
            hashes.append(string_hashes([info.path for info in page]))
            sizes.append(np.array([info.size for info in page], dtype=np.int64))
        joined = np.concatenate(hashes)
        order = np.argsort(joined, kind="stable")
        self._hashes, self._sizes = joined[order], np.concatenate(sizes)[order]

    def __len__(self) -> int:
        return len(self._hashes)

    def __getitem__(self, path: str) -> int:
        wanted = string_hashes([path])[0]
        at = int(np.searchsorted(self._hashes, wanted))
        if at == len(self._hashes) or self._hashes[at] != wanted:
            raise KeyError(path)
        return int(self._sizes[at])


def _file_problem(store: Storage, path: str, size: int, algorithm: str, checksum: str | None,
                  listed: dict[str, int] | ListedSizes | None = None) -> str | None:
    try:
        actual = store.file_size(path) if listed is None else listed[path]
    except (FileNotFoundError, KeyError):
        return f"{path}: listed in the manifest but missing"
    if actual != size:
        return f"{path}: {actual} bytes, the manifest says {size} (truncated or overwritten)"
    if checksum is not None and store.checksum(path, algorithm) != checksum:
        return f"{path}: {algorithm} differs from the manifest (corrupt)"
    return None


def _header_problem(store: Storage, path: str, entry: ShardEntry, shape: tuple[int, int, int], encoding: str,
                    bucketed: bool) -> str | None:
    """A shard file's own word on its count and image size (a raw ``.npy`` header's shape, a JPEG shard's
    header and its first image's frame size) against its index row's, or None when they agree."""
    height, width = (0, 0) if encoding == NONE else (shape[0], shape[1])  # none: the header alone (N, 0, 0, 3)
    listed = (f"the index lists {entry.samples} of bucket {entry.bucket} ({height}x{width})" if bucketed
              else f"the manifest lists {entry.samples} of {height}x{width}")
    try:
        if encoding == YUV420:
            count, sample_bytes = parse_yuv_header(store.read_range(path, 0, HEADER_BYTES), path)
            if (count, sample_bytes) == (entry.samples, yuv_sample_bytes(height, width)):
                return None
            return (f"{path}: its header says {count} samples of {sample_bytes} bytes, {listed} "
                    f"({yuv_sample_bytes(height, width)} bytes each: the index and the shard disagree: an edited "
                    "index, or a shard file from elsewhere)")
        if encoding in (RAW, NONE):
            count, found_h, found_w = parse_npy_header(store.read_range(path, 0, HEADER_BYTES), path)
        else:
            start = jpeg_data_start(entry.samples)
            head = store.read_range(path, 0, start)
            count = parse_jpeg_header(head[:HEADER_BYTES], path)
            begin, end = (int(x) for x in np.frombuffer(head, dtype="<u8", count=2, offset=HEADER_BYTES))
            frame = None if end <= begin else jpeg_frame_size(store.read_range(path, start + begin, end - begin))
            if frame is None:
                return f"{path}: sample 0 is not a JPEG with a frame header (corrupt)"
            found_h, found_w = frame
    except ShardFormatError as e:
        return str(e)
    if (count, found_h, found_w) == (entry.samples, height, width):
        return None
    return (f"{path}: its header says {count} images of {found_h}x{found_w}, {listed} "
            "(the index and the shard disagree: an edited index, or a shard file from elsewhere)")


def shard_problem(root: DatasetRoot, entry: ShardEntry, shape: tuple[int, int, int],
                  checksums: bool = False, listed: dict[str, int] | ListedSizes | None = None,
                  encoding: str = RAW, bucketed: bool = False, outputs: Sequence[OutputSpec] = ()) -> str | None:
    """What is wrong with one listed shard (its .npy, its .jsonl and its model ``outputs``' files), or None: the
    size the format implies (at ``shape``, the shard's own: its bucket's in a bucketed dataset) and
    each file's size, O(1); with ``checksums`` also each file's checksum (reads every byte) and the
    shard's header against ``shape`` (``bucketed``: said as the entry's bucket). ``listed``
    (path -> size, from one listing) saves a request per file on object storage. ``encoding``: the
    manifest's (a JPEG shard's size is the listed one; its offsets are checked when it is mapped).
    ``root``: the dataset's, opened by the caller."""
    store, directory = root.storage, root.path
    expected = expected_shard_size(entry, shape, encoding)
    if entry.bytes != expected:
        return (f"{store.join(directory, entry.path)}: the manifest lists {entry.bytes} bytes, "
                f"{entry.samples} samples imply {expected} (inconsistent)")
    for rel, size, checksum in ((entry.path, entry.bytes, entry.checksum),
                                (entry.meta_path, entry.meta_bytes, entry.meta_checksum)):
        problem = _file_problem(store, store.join(directory, rel), size, entry.checksum_algorithm,
                                checksum if checksums else None, listed)
        if problem is not None:
            return problem
    if checksums:
        problem = _header_problem(store, store.join(directory, entry.path), entry, shape, encoding, bucketed)
        if problem is not None:
            return problem
    return _outputs_problem(root, entry, outputs, checksums, listed)


def _outputs_problem(root: DatasetRoot, entry: ShardEntry, outputs: Sequence[OutputSpec], checksums: bool,
                     listed: dict[str, int] | ListedSizes | None) -> str | None:
    """What is wrong with a shard's output files (spec, "Model outputs"): the size its count and its bucket's
    shape imply, O(1); with ``checksums`` each file's xxh3_128 and its header too."""
    store = root.storage
    if len(entry.outputs) != len(outputs):
        return (f"{root.join(entry.path)}: the index lists {len(entry.outputs)} output digests, the dataset has "
                f"{len(outputs)} outputs (inconsistent)")
    for output, digest in zip(outputs, entry.outputs):
        path = root.join(output_path(entry.path, output.name))
        shape = output.shapes[entry.bucket]
        if shape is None:
            return f"{path}: the root records no shape of output {output.name!r} for bucket {entry.bucket}"
        problem = _file_problem(store, path, output_nbytes(entry.samples, shape, output.descr), XXH3_128,
                                digest if checksums else None, listed)
        if problem is not None:
            return problem
        if checksums:
            header = store.read_range(path, 0, HEADER_BYTES)
            if header != output_header(output.descr, entry.samples, shape):
                try:
                    descr, found = parse_output_header(header, path)
                except ShardFormatError as e:
                    return str(e)
                return (f"{path}: its header says {descr} {list(found)}, the index says {output.descr} "
                        f"{[entry.samples, *shape]} (the index and the file disagree)")
    return None


# Shards checked per batch of threads: a dataset of millions of shards is never held as a list of entries.
_CHUNK = 4096


def shard_problems(root: DatasetRoot, manifest: Manifest | DatasetIndex, shards: Iterable[ShardEntry] | None = None,
                   checksums: bool = False, threads: int = 1) -> list[tuple[ShardEntry, str]]:
    """``shard_problem`` for each of ``shards`` (default: every listed shard), as (entry, problem) pairs.
    Both hashes release the GIL while they read (xxh3_128: tens of GB/s a core from cache; an old shard's
    sha256: ~1-2 GB/s), so a few ``threads`` keep a disk busy. Entries are taken ``_CHUNK`` at a time (a
    ``DatasetIndex`` makes each when it is reached), so memory holds a chunk, not the dataset."""
    store, directory = root.storage, root.path
    listed: ListedSizes | None = None
    check = lambda entry: shard_problem(root, entry, manifest.bucket_shape(entry.bucket),  # noqa: E731
                                        checksums, listed, manifest.encoding, manifest.is_bucketed,
                                        getattr(manifest, "outputs", ()))
    found: list[tuple[ShardEntry, str]] = []
    entries = iter(manifest.shards if shards is None else shards)
    with ThreadPoolExecutor(threads) if threads > 1 else nullcontext() as pool:
        while chunk := list(itertools.islice(entries, _CHUNK)):
            if listed is None and not store.is_local:
                # One LIST per 1,000 objects instead of two HEADs per shard (once, and only with a shard to check),
                # streamed into 16 bytes a file.
                listed = ListedSizes(store.iter_file_pages(store.join(directory, SHARDS_DIR)))  # type: ignore[attr-defined]
            problems = list(pool.map(check, chunk)) if pool is not None and len(chunk) > 1 else map(check, chunk)
            found += [(entry, problem) for entry, problem in zip(chunk, problems) if problem is not None]
    return found
