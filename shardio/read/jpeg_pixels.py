"""A JPEG shard's samples as the reader sees them: the same N×H×W×3 uint8 interface as a raw shard's memory
map, decoded only when pixels are asked for, and a batch decoded in one native call.

``JpegPixels`` is what ``DatasetSnapshot.pixels`` gives for an ``encoding: jpeg`` dataset: slicing it
(``pixels[a:b]``, what batches, subsets and mixing do) costs nothing; indexing one sample or ``np.asarray``
decodes. ``decode_batch`` decodes the slices of one batch into one buffer with
``shardio.read._jpeg_batch.decode_into``: a pthread pool over all cores with the GIL released, so the training
loop and the prefetch thread run meanwhile. A bad sample is a ShardIntegrityError naming the shard file and
the sample index in it.

``EncodedImages`` is a batch still encoded: each sample's JPEG bytes as a numpy view of the mapped shard
(no copy) with the shards and sample numbers they come from, for a decoder elsewhere (the GPU's:
``shardio.train.device_decode``) that reports a bad sample the same way; ``EncodedImages.decode`` is the
CPU decode of the same bytes.

The extension is optional (a reader install may lack a compiler or the libjpeg headers): raw datasets never
import it; a JPEG dataset without it is an error that says what to install.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from shardio.errors import MissingExtra, ShardIntegrityError
from shardio.format.jpeg_shard import check_offsets, jpeg_data_start, parse_jpeg_header

try:  # the optional compiled extension (setup.py); raw datasets never need it
    from shardio.read import _jpeg_batch
    _import_error: ImportError | None = None
except ImportError as e:
    _jpeg_batch, _import_error = None, e

__all__ = ["EncodedImages", "JpegPixels", "map_jpeg_shard", "decode_batch", "decode_threads", "check_decoded_bytes",
           "decoded_bytes_budget"]


def _decoder() -> Any:
    if _jpeg_batch is None:
        raise MissingExtra(
            "this dataset's shards are JPEG (encoding: jpeg); decoding them needs shardio's compiled "
            "extension shardio.read._jpeg_batch, which this install lacks: install a C compiler and the "
            "libjpeg-turbo headers (Debian/Ubuntu: apt install build-essential libjpeg-turbo8-dev or "
            "libjpeg62-turbo-dev; conda: libjpeg-turbo) and reinstall shardio "
            f"(pip install --force-reinstall --no-deps ...); import error: {_import_error}") from _import_error
    return _jpeg_batch


def decoded_bytes_budget() -> int:
    """The most bytes one decode may fill (a batch, or a whole shard asked for at once):
    ``SHARDIO_MAX_DECODED_BYTES``, else half this machine's memory. A JPEG shard is small whatever
    H×W its root claims (23 KB an image at 256²): the decoded size is what a reader allocates, so it is
    checked before allocating, not found as a MemoryError (or the OOM killer) naming nothing."""
    configured = os.environ.get("SHARDIO_MAX_DECODED_BYTES")
    if configured:
        try:
            return int(configured)
        except ValueError:
            raise ValueError(f"SHARDIO_MAX_DECODED_BYTES={configured!r} is not a number of bytes") from None
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2
    except (ValueError, OSError, AttributeError):  # no sysconf (not POSIX): a bound that still stops a forgery
        return 8 << 30


def check_decoded_bytes(count: int, height: int, width: int, where: str) -> None:
    """ValueError naming ``where`` (the dataset, or the shard) when ``count`` decoded H×W×3 images exceed
    ``decoded_bytes_budget()``; raised before anything is allocated."""
    nbytes = count * height * width * 3
    budget = decoded_bytes_budget()
    if nbytes > budget:
        raise ValueError(
            f"{where}: decoding {count} JPEG image(s) of {height}x{width} takes {nbytes / 1e9:.2f} GB, over the "
            f"budget of {budget / 1e9:.2f} GB (half this machine's memory, or SHARDIO_MAX_DECODED_BYTES): use a "
            "smaller batch_size, or raise the budget if the memory is there")


def decode_threads() -> int:
    """Threads a batch decode uses: the cores this process may run on, or ``SHARDIO_DECODE_THREADS``."""
    configured = os.environ.get("SHARDIO_DECODE_THREADS")
    if configured:
        return max(1, int(configured))
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


class JpegPixels:
    """Samples ``first .. first + len`` of a JPEG shard (``path``): offsets into ``data``, decoded to
    (H, W, 3) uint8 on demand, H×W being the shard's own shape (its bucket's in a bucketed dataset)."""

    def __init__(self, path: str, offsets: np.ndarray, data: np.ndarray, height: int, width: int,
                 first: int = 0) -> None:
        self.path, self.offsets, self.data = path, offsets, data
        self.height, self.width, self.first = height, width, first

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (len(self), self.height, self.width, 3)

    dtype = np.dtype(np.uint8)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def jpegs(self) -> list[memoryview]:
        """Each sample's JPEG bytes (views into the shard's memory map: no copy)."""
        bounds = self.offsets.tolist()
        view = memoryview(self.data)
        return [view[a:b] for a, b in zip(bounds[:-1], bounds[1:])]

    def arrays(self) -> list[np.ndarray]:
        """Each sample's JPEG bytes as a uint8 array viewing the shard's memory map (no copy; a pickled one
        carries its own bytes only, not the shard's)."""
        bounds = self.offsets.tolist()
        data = np.asarray(self.data)  # a plain ndarray view: slicing an np.memmap costs more per piece
        return [data[a:b] for a, b in zip(bounds[:-1], bounds[1:])]

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step != 1:
                return self.decode()[index]
            stop = max(start, stop)
            return JpegPixels(self.path, self.offsets[start:stop + 1], self.data, self.height, self.width,
                              self.first + start)
        if isinstance(index, (int, np.integer)):
            i = int(index) + (len(self) if index < 0 else 0)
            if not 0 <= i < len(self):
                raise IndexError(f"sample {index} of {len(self)}")
            return self[i:i + 1].decode()[0]
        return self.decode()[index]

    def decode(self, out: np.ndarray | None = None) -> np.ndarray:
        """Every sample decoded, into ``out`` (N×H×W×3 uint8, C-contiguous) or a new array."""
        if out is None:
            check_decoded_bytes(len(self), self.height, self.width, self.path)
            out = np.empty(self.shape, np.uint8)
        decode_batch([self], out)
        return out

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        pixels = self.decode()
        return pixels if dtype is None else pixels.astype(dtype)

    def __iter__(self) -> Iterator[np.ndarray]:
        return iter(self.decode())


def map_jpeg_shard(path: str, local_path: str, samples: int, height: int, width: int) -> JpegPixels:
    """The JPEG shard file at ``local_path`` (``path`` names it in errors) memory-mapped, its header and
    offsets checked against ``samples`` and the file's size (ShardFormatError / ShardIntegrityError)."""
    with open(local_path, "rb") as f:
        count = parse_jpeg_header(f.read(128), path)
        size = os.fstat(f.fileno()).st_size
    if count != samples:
        raise ShardIntegrityError(f"{path}: header says {count} samples, the manifest says {samples}")
    start = jpeg_data_start(count)
    if size < start:
        raise ShardIntegrityError(f"{path}: {size} bytes, its header and offsets alone take {start} "
                                  "(truncated); HINT: run `preprocess verify DIR --repair`")
    # Copy-on-write like a raw shard's map; the offsets are read once per map (8 KB for 1,000 samples).
    mapped = np.memmap(local_path, dtype=np.uint8, mode="c")
    offsets = mapped[128:start].view("<u8").astype(np.int64)
    check_offsets(offsets, size, path)
    return JpegPixels(path, offsets, mapped[start:], height, width)


@dataclass(frozen=True)
class EncodedImages:
    """One batch's images still encoded, in batch order: ``jpegs[i]`` is sample i's JPEG (uint8 views of
    the shard maps), each decoding to ``height`` × ``width`` × 3. ``sources`` lists the batch's runs as
    ``(shard path, first sample in the shard, samples)``, so any decoder names a bad sample by shard and
    sample (``bad_sample``). What ``ShardDataset(decode="device")`` puts in a batch's ``image``."""

    jpegs: list[np.ndarray]
    height: int
    width: int
    sources: list[tuple[str, int, int]]

    @classmethod
    def of(cls, pieces: Sequence[JpegPixels]) -> EncodedImages:
        """The samples of ``pieces`` (slices of JPEG shards), in order; their bytes are not copied."""
        _one_shape(pieces)
        jpegs: list[np.ndarray] = []
        for piece in pieces:
            jpegs.extend(piece.arrays())
        return cls(jpegs, pieces[0].height, pieces[0].width,
                   [(piece.path, piece.first, len(piece)) for piece in pieces])

    def __len__(self) -> int:
        return len(self.jpegs)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """The decoded batch's shape: (B, H, W, 3)."""
        return (len(self), self.height, self.width, 3)

    def nbytes(self) -> int:
        """The compressed bytes of the batch (what a device decode copies to the device)."""
        return sum(len(jpeg) for jpeg in self.jpegs)

    def bad_sample(self, index: int, reason: str) -> ShardIntegrityError:
        """The error for the batch's ``index``-th sample: its shard file, its sample number, ``reason``."""
        for path, first, count in self.sources:
            if index < count:
                return ShardIntegrityError(f"{path}: sample {first + index}: {reason}; HINT: run "
                                           "`preprocess verify DIR --repair` to rebuild it from its input")
            index -= count
        raise IndexError(f"sample {index} past the end of a batch of {len(self)}")

    def decode(self, out: np.ndarray | None = None, threads: int | None = None) -> np.ndarray:
        """The batch decoded on the CPU (the extension, as a decoded batch is): uint8 (B, H, W, 3)."""
        if out is None:
            check_decoded_bytes(len(self), self.height, self.width, self.sources[0][0] if self.sources else "batch")
            out = np.empty(self.shape, np.uint8)
        _decode_into(self, self.jpegs, out, threads)
        return out


def decode_batch(pieces: Sequence[JpegPixels], out: np.ndarray, threads: int | None = None) -> None:
    """Decode the samples of ``pieces``, in order, into ``out`` (count×H×W×3 uint8, C-contiguous) on
    ``threads`` native threads (default ``decode_threads()``), the GIL released."""
    jpegs: list[memoryview] = []
    for piece in pieces:
        jpegs.extend(piece.jpegs())
    if not pieces:
        _decoder()  # without the extension a JPEG dataset says what to install, even on an empty batch
        return
    _one_shape(pieces)
    names = EncodedImages([], pieces[0].height, pieces[0].width,
                          [(piece.path, piece.first, len(piece)) for piece in pieces])
    _decode_into(names, jpegs, out, threads)


def _one_shape(pieces: Sequence[JpegPixels]) -> None:
    """ValueError when ``pieces`` are not all of one shape: a batch is one bucket (one H×W)."""
    shapes = {(piece.height, piece.width) for piece in pieces}
    if len(shapes) > 1:
        raise ValueError(f"a batch holds images of one shape; these pieces have {sorted(shapes)} (shards of "
                         f"different buckets: {pieces[0].path} and others)")


def _decode_into(batch: EncodedImages, jpegs: Sequence[Any], out: np.ndarray, threads: int | None) -> None:
    """``jpegs`` (bytes-like, in order) into ``out``; a bad one raises ``batch.bad_sample``."""
    decoder = _decoder()
    if not jpegs:
        return
    failed = decoder.decode_into(jpegs, out, batch.height, batch.width, threads or decode_threads())
    if failed is not None:
        index, reason = failed
        raise batch.bad_sample(index, reason)
