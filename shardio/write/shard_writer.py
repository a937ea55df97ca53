"""Writing shards and the manifest, atomically (see ``shardio.format`` for the layout; every file goes
in and out of the dataset directory through ``shardio.write.staging``: staged, promoted, discarded).

A ``ShardWriter`` streams images straight into a temp file (header placeholder, pixels, then the real
header), so a worker holds one image at a time, not a shard: memory stays flat whatever
``samples_per_shard`` is. A ``JpegShardWriter`` (``encoding: jpeg``) holds its shard's JPEGs until commit
(the offsets come first in the file): ~23 MB for 1,000 images of 256², a tenth of one raw shard. A
``YuvShardWriter`` (``encoding: yuv420``) streams each image's planes as a ``ShardWriter`` streams pixels
(fixed size a sample: ``shardio.format.yuv_shard``). Checksums are
``xxh3_128`` (``shardio.store.checksum.WRITE_ALGORITHM``): the ``.jsonl``'s streams as it is written; the
pixel file's (of the whole file, so ``xxh128sum`` agrees) is taken at commit from the page cache, once the
header is final.

An ``OutputFileWriter`` writes one shard's model outputs (spec, "Model outputs"): ``shards/STEM-NNNNN.NAME.npy``
beside the shard, staged, fsynced and promoted as a shard file is; ``InputShardWriter.add_outputs`` writes every
output file of an input's shards once its models are through, and its ``abort`` removes them with the shards.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from shardio.write import staging
from shardio.write.commit import commit
from shardio.store.root import DatasetRoot, Place, open_root
from shardio.store.checksum import WRITE_ALGORITHM, file_checksum, new_hasher
from shardio.format import (
    HEADER_BYTES,
    JPEG,
    NONE,
    RAW,
    YUV420,
    Manifest,
    ShardEntry,
    npy_header,
)
from shardio.format.model_outputs import TORCH_DTYPES, output_header, output_path
from shardio.format.jpeg_shard import JPEG_SUFFIX, jpeg_data_start, jpeg_header
from shardio.format.yuv_shard import YUV_SUFFIX, rgb_to_yuv420, yuv_header, yuv_sample_bytes

__all__ = ["ShardWriter", "JpegShardWriter", "YuvShardWriter", "NoPixelShardWriter", "SHARD_WRITERS",
           "InputShardWriter", "OutputFileWriter", "write_manifest"]


# Bytes written between two requests to start writing a shard back to disk (see ``_start_writeback``).
WRITEBACK_BYTES = 8 << 20


def _libc_sync_file_range() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    function.restype = ctypes.c_int
    return function


_sync_file_range = _libc_sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2


def _start_writeback(fd: int, offset: int) -> None:
    """Ask Linux to start writing the file from ``offset`` to its end to disk now, without waiting: the commit's
    fsync then waits for the last few MB only (17 -> 3 ms for a 39 MB shard on the dev VM's disk), time the
    worker's core would sit idle. Elsewhere (or if the call fails) the fsync does all of it, as before."""
    if _sync_file_range is not None:
        _sync_file_range(fd, offset, 0, _SYNC_FILE_RANGE_WRITE)  # length 0: to the end of the file


@dataclass
class _OpenFile:
    tmp_path: str
    rel_path: str  # its name in the dataset directory once promoted
    handle: Any
    digest: Any  # None: hashed at commit instead
    in_place: bool  # the dataset's own file once renamed (to disk before a commit), not a scratch copy to upload
    nbytes: int = 0
    written_back: int = 0  # ``nbytes`` when writeback was last started

    def write(self, data: bytes | memoryview) -> None:
        self.handle.write(data)
        if self.digest is not None:
            self.digest.update(data)
        self.nbytes += len(data)
        if self.in_place and self.nbytes - self.written_back >= WRITEBACK_BYTES:
            self.handle.flush()
            # ``nbytes`` counts this file's data bytes, which start at or after file offset ``nbytes``.
            _start_writeback(self.handle.fileno(), self.written_back)
            self.written_back = self.nbytes

    def finish(self) -> None:
        """Flush and close; a file staged in place is fsynced first. A scratch copy is not: the upload that
        promotes it is the durable step, and its pages are read from memory and dropped with the file."""
        self.handle.flush()
        if self.in_place:
            os.fsync(self.handle.fileno())
        self.handle.close()


def _open_temp(root: DatasetRoot, rel_path: str, hashed: bool) -> _OpenFile:
    fd, tmp = staging.stage(root, rel_path)
    return _OpenFile(tmp, rel_path, os.fdopen(fd, "wb"), new_hasher(WRITE_ALGORITHM) if hashed else None,
                     root.storage.stages_in_place)


class ShardWriter:
    """One shard: ``add`` images of shape (H, W, 3) uint8 with their metadata, then ``commit``. ``bucket``:
    the id its entry carries in a bucketed dataset (H×W being that bucket's shape; spec, "Buckets")."""

    pixel_suffix = ".npy"

    def __init__(self, place: Place, name: str, height: int, width: int, bucket: int = 0) -> None:
        self.root = open_root(place)
        self.directory = self.root.path
        self.rel_path, self.rel_meta = staging.shard_paths(name, self.pixel_suffix)
        self.height, self.width, self.bucket = height, width, bucket
        self.count = 0
        self._pixels = _open_temp(self.root, self.rel_path, hashed=False)
        try:
            self._meta = _open_temp(self.root, self.rel_meta, hashed=True)
        except BaseException:
            self._pixels.handle.close()
            staging.discard_staged(self.root, self._pixels.tmp_path)
            raise
        self._start_pixels()

    def _start_pixels(self) -> None:
        # Placeholder: the real header (with the final count) is written at commit.
        self._pixels.handle.write(b"\0" * HEADER_BYTES)

    def _header(self) -> bytes:
        """The pixel file's final 128-byte header, for the samples added."""
        return npy_header(self.count, self.height, self.width)

    def _finish_pixels(self) -> int:
        """Make the pixel file final (before its checksum); returns its size."""
        pixels = self._pixels
        pixels.handle.seek(0)
        pixels.handle.write(self._header())
        return HEADER_BYTES + pixels.nbytes

    def add(self, pixels: np.ndarray, meta: dict[str, Any]) -> None:
        if pixels.shape != (self.height, self.width, 3) or pixels.dtype != np.uint8:
            raise ValueError(f"image {pixels.shape} {pixels.dtype} != ({self.height}, {self.width}, 3) uint8")
        self._write_pixels(pixels)
        self._add_meta(meta)

    def _write_pixels(self, pixels: np.ndarray) -> None:
        self._pixels.write(memoryview(np.ascontiguousarray(pixels)).cast("B"))

    def _add_meta(self, meta: dict[str, Any]) -> None:
        """The sample's ``.jsonl`` line, after its pixels: it counts once both are written."""
        line = json.dumps(meta, ensure_ascii=False, separators=(",", ":")) + "\n"
        self._meta.write(line.encode("utf-8"))
        self.count += 1

    def commit(self, input_name: str) -> ShardEntry:
        """Finish both files and rename them into place; returns the manifest entry."""
        pixels = self._pixels
        nbytes = self._finish_pixels()
        pixels.handle.flush()
        # Hashed once, here, from the page cache: the exact bytes on disk, header included.
        checksum = file_checksum(pixels.tmp_path, WRITE_ALGORITHM)
        for handle in (pixels, self._meta):
            handle.finish()
        staging.promote(self.root, self._meta.tmp_path, self.rel_meta)
        staging.promote(self.root, pixels.tmp_path, self.rel_path)
        return ShardEntry(
            path=self.rel_path,
            meta_path=self.rel_meta,
            samples=self.count,
            bytes=nbytes,
            checksum=checksum,
            meta_bytes=self._meta.nbytes,
            meta_checksum=self._meta.digest.hexdigest(),
            input=input_name,
            checksum_algorithm=WRITE_ALGORITHM,
            bucket=self.bucket,
        )

    def abort(self) -> None:
        for handle in (self._pixels, self._meta):
            try:
                handle.handle.close()
            except OSError:
                pass  # e.g. ENOSPC flushing the buffer: the file is being removed anyway
            staging.discard_staged(self.root, handle.tmp_path)


class JpegShardWriter(ShardWriter):
    """One JPEG shard (``shardio.format.jpeg_shard``): ``add`` each image as the bytes of an H×W×3 JPEG
    (the job encodes it), then ``commit``. The JPEGs are held until commit, where the header, offsets and
    data are written in one pass."""

    pixel_suffix = JPEG_SUFFIX

    def _start_pixels(self) -> None:
        self._jpegs: list[bytes] = []

    def add(self, jpeg: bytes, meta: dict[str, Any]) -> None:  # type: ignore[override]
        if not isinstance(jpeg, (bytes, bytearray)) or not jpeg.startswith(b"\xff\xd8"):
            raise ValueError(f"{self.rel_path}: sample {self.count} is not JPEG bytes")
        self._jpegs.append(bytes(jpeg))
        self._add_meta(meta)

    def _finish_pixels(self) -> int:
        sizes = np.fromiter((len(j) for j in self._jpegs), np.uint64, len(self._jpegs))
        offsets = np.zeros(self.count + 1, "<u8")
        np.cumsum(sizes, out=offsets[1:])
        self._pixels.write(jpeg_header(self.count))
        self._pixels.write(offsets.tobytes())
        for jpeg in self._jpegs:
            self._pixels.write(jpeg)
        self._jpegs = []
        return jpeg_data_start(self.count) + int(offsets[-1])


class YuvShardWriter(ShardWriter):
    """One yuv420 shard (``shardio.format.yuv_shard``): ``add`` each image as its planes (S,) uint8 (the job
    converts it: ``shardio.format.yuv_shard.rgb_to_yuv420``) or as H×W×3 uint8 RGB, converted here; streamed
    to the file as a raw shard's pixels are."""

    pixel_suffix = YUV_SUFFIX

    def _header(self) -> bytes:
        return yuv_header(self.count, self.height, self.width)

    def add(self, pixels: np.ndarray, meta: dict[str, Any]) -> None:
        if pixels.shape == (self.height, self.width, 3) and pixels.dtype == np.uint8:
            pixels = rgb_to_yuv420(pixels)
        sample_bytes = yuv_sample_bytes(self.height, self.width)
        if pixels.shape != (sample_bytes,) or pixels.dtype != np.uint8:
            raise ValueError(f"{self.rel_path}: sample {self.count} is {pixels.shape} {pixels.dtype}, not the "
                             f"({sample_bytes},) uint8 planes of a {self.height}x{self.width} image (nor its RGB)")
        self._write_pixels(pixels)
        self._add_meta(meta)


class NoPixelShardWriter(ShardWriter):
    """One shard of a dataset without pixels (``encoding: none``: spec, "Model outputs"): ``add`` takes each
    image (the job's models were given it) and keeps its metadata only; the pixel file is its header alone,
    shape (N, 0, 0, 3)."""

    def _write_pixels(self, pixels: np.ndarray) -> None:
        pass  # checked by ``add``, given to the models, not kept

    def _header(self) -> bytes:
        return npy_header(self.count, 0, 0)


# Each encoding's shard writer (the config's ``encoding``: spec, "Pixel encodings", "Model outputs").
SHARD_WRITERS: dict[str, type[ShardWriter]] = {RAW: ShardWriter, JPEG: JpegShardWriter, YUV420: YuvShardWriter,
                                               NONE: NoPixelShardWriter}


class OutputFileWriter:
    """The file of output ``name`` of the shard whose pixel file is ``shard_path`` (``output_path``): ``write``
    its samples' values, an array (N, *sample shape) of one of the output dtypes (``TORCH_DTYPES``' descrs;
    bfloat16 as its raw ``uint16`` bits), as the fixed 128-byte header then the values, C order; staged, fsynced
    and promoted as a shard file is. Returns the file's xxh3_128 hex digest (what the shard's entry lists)."""

    def __init__(self, place: Place, shard_path: str, name: str) -> None:
        self.root = open_root(place)
        self.rel_path = output_path(shard_path, name)

    def write(self, values: np.ndarray, descr: str | None = None) -> str:
        """Write the file; ``descr``: the file's dtype (default: the array's, which must be an output dtype)."""
        descr = np.dtype(values.dtype).str if descr is None else descr
        if descr not in TORCH_DTYPES.values() or np.dtype(values.dtype) != np.dtype(descr) or values.ndim < 2:
            raise ValueError(f"{self.rel_path}: values {values.dtype} {list(values.shape)} are not (N, ...) of an "
                             f"output dtype ({', '.join(sorted(set(TORCH_DTYPES.values())))}), as {descr!r}")
        out = _open_temp(self.root, self.rel_path, hashed=True)
        try:
            out.write(output_header(descr, values.shape[0], values.shape[1:]))
            out.write(memoryview(np.ascontiguousarray(values)).cast("B"))
            out.finish()
        except BaseException:
            try:
                out.handle.close()
            except OSError:
                pass
            staging.discard_staged(self.root, out.tmp_path)
            raise
        staging.promote(self.root, out.tmp_path, self.rel_path)
        return str(out.digest.hexdigest())


# Partial shards an input's close commits at once (fsyncs or uploads in flight together).
_CLOSE_THREADS = 8


class InputShardWriter:
    """All shards of one input, ``samples_per_shard`` each (the last one partial), named deterministically.

    Names are ``{stem}-{index:05d}``: the same input and config give the same files, byte for byte. On
    ``abort`` every file this writer made is removed, so a failed input leaves nothing behind.

    Buckets (a bucketed dataset: ``buckets`` its list of (h, w), spec "Buckets"): ``add(..., bucket=b)``
    puts each sample into a shard of bucket ``b``'s shape, so every shard holds one bucket. One shard per
    bucket is open at a time (raw: two open files each, memory flat; JPEG: each open shard's JPEGs, up to
    ``samples_per_shard`` per bucket). A shard's number is taken when it is opened, counting across the
    input's buckets (``STEM-00000`` may be bucket 3, ``STEM-00001`` bucket 0): the same samples in the same
    order give the same names and bytes. At ``close`` the partial shards are committed in bucket order.
    Without ``buckets`` there is one bucket, 0, of ``height`` × ``width``.

    A full shard is committed (checksum, fsync, rename) on a background thread while the next one fills:
    the fsync of a 197 MB shard blocks ~0.5 s on this VM's disk, 0.5 ms per image the decoder would
    otherwise wait. At most one commit is pending, so unsynced data stays under two shards.
    """

    def __init__(self, place: Place, stem: str, height: int, width: int, samples_per_shard: int,
                 encoding: str = RAW, buckets: Sequence[tuple[int, int]] | None = None) -> None:
        if encoding not in SHARD_WRITERS:
            raise ValueError(f"encoding must be one of {', '.join(map(repr, SHARD_WRITERS))}, got {encoding!r}")
        self.root, self.stem = open_root(place), stem
        self.directory = self.root.path
        self.shard_class = SHARD_WRITERS[encoding]
        self.height, self.width = height, width
        self.shapes = [(int(h), int(w)) for h, w in buckets] if buckets is not None else [(height, width)]
        self.samples_per_shard = samples_per_shard
        self.entries: list[ShardEntry] = []
        self._open: dict[int, ShardWriter] = {}  # bucket -> its shard being filled
        self._made: list[ShardWriter] = []
        self._pending: Future[ShardEntry] | None = None
        self._committer: ThreadPoolExecutor | None = None
        self._outputs: list[str] = []  # output files promoted (``add_outputs``), removed by ``abort``

    def add(self, pixels: np.ndarray | bytes, meta: dict[str, Any], input_name: str, bucket: int = 0) -> str:
        """``pixels``: an h×w×3 uint8 array of ``bucket``'s shape, a JPEG's bytes for ``encoding: jpeg``, its
        planes (or its RGB) for ``encoding: yuv420``. Returns the pixel file of the shard it went to (what its
        entry's ``path`` will be)."""
        current = self._open.get(bucket)
        if current is None:
            if not 0 <= bucket < len(self.shapes):
                raise ValueError(f"bucket {bucket}: this writer has {len(self.shapes)} bucket(s)")
            name = f"{self.stem}-{len(self._made):05d}"
            height, width = self.shapes[bucket]
            current = self._open[bucket] = self.shard_class(self.root, name, height, width, bucket)
            self._made.append(current)
        current.add(pixels, meta)
        if current.count >= self.samples_per_shard:
            del self._open[bucket]
            self._commit_in_background(current, input_name)
        return current.rel_path

    def add_outputs(self, outputs: Mapping[str, Sequence[tuple[str, np.ndarray]]]) -> list[ShardEntry]:
        """After ``close``: write each shard's output files (``outputs``: a shard's ``path`` -> its (name, values)
        in the dataset's outputs order, values (samples, ...) in the shard's order) and return every entry
        with its ``outputs`` digests. ``abort`` removes these files too."""
        entries = []
        for entry in self.entries:
            digests = []
            for name, values in outputs[entry.path]:
                if len(values) != entry.samples:
                    raise ValueError(f"{entry.path}: {len(values)} values of output {name!r} for its "
                                     f"{entry.samples} samples")
                writer = OutputFileWriter(self.root, entry.path, name)
                self._outputs.append(writer.rel_path)
                digests.append(writer.write(values))
            entries.append(replace(entry, outputs=tuple(digests)))
        self.entries = entries
        return entries

    def _commit_in_background(self, shard: ShardWriter, input_name: str) -> None:
        self._wait_pending()
        if self._committer is None:
            self._committer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard-commit")
        self._pending = self._committer.submit(shard.commit, input_name)

    def _wait_pending(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self.entries.append(pending.result())  # re-raises a failed commit (e.g. ENOSPC) here

    def _stop_committer(self) -> None:
        if self._committer is not None:
            self._committer.shutdown(wait=True)
            self._committer = None

    def close(self, input_name: str) -> list[ShardEntry]:
        """Commit the partial shards (one per bucket that has one) and return every shard's entry. A
        bucketed input's partial shards are committed together, on threads: each commit's fsync (or upload)
        waits on the storage, and an input of a few hundred images leaves one per bucket."""
        try:
            self._wait_pending()
            partial = []
            for bucket in sorted(self._open):
                current = self._open.pop(bucket)
                if current.count:
                    partial.append(current)
                else:
                    current.abort()
            if len(partial) > 1:
                with ThreadPoolExecutor(max_workers=min(len(partial), _CLOSE_THREADS),
                                        thread_name_prefix="shard-close") as pool:
                    self.entries.extend(pool.map(lambda shard: shard.commit(input_name), partial))
            else:
                self.entries.extend(shard.commit(input_name) for shard in partial)
        finally:
            self._stop_committer()
        return self.entries

    def abort(self) -> None:
        if self._pending is not None:
            self._pending.exception()  # wait for it; its outcome no longer matters
            self._pending = None
        self._stop_committer()
        for current in self._open.values():
            current.abort()
        self._open = {}
        for shard in self._made:
            shard.abort()
            staging.discard(self.root, shard.rel_path)
            staging.discard(self.root, shard.rel_meta)
        for rel_path in self._outputs:
            staging.discard(self.root, rel_path)
        self._made, self._outputs = [], []
        self.entries = []


def write_manifest(place: Place, manifest: Manifest) -> int:
    """Commit the manifest as the dataset's next generation through the directory's one commit
    (``shardio.write.commit.commit``: shards in dataset order, durable before ``manifest.json``, whose
    rename is the commit of everything it lists). Returns the generation."""
    return commit(place, manifest)
