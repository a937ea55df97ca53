"""A yuv420 shard's samples as the reader sees them: the same N×H×W×3 uint8 interface as a raw shard's memory
map, converted to RGB only when pixels are asked for, and a batch converted in one native call.

``YuvPixels`` is what ``DatasetSnapshot.pixels`` gives for an ``encoding: yuv420`` dataset: slicing it
(``pixels[a:b]``, what batches, subsets and mixing do) is a slice of the (N, S) planes map and costs nothing;
indexing one sample or ``np.asarray`` converts. ``convert_batch`` converts the slices of one batch into one
buffer with ``shardio.read._gather.yuv420_into`` (the native gather's extension: SSSE3, the GIL released,
``threads`` threads), or, where the extension is not built, with numpy (``shardio.format.yuv_shard.yuv420_to_rgb``):
the same bytes either way (the tests hold it).

``YuvPlanes`` is a batch left as planes (``ShardDataset(decode="device")``): its (B, S) uint8 tensor, half a
raw batch's bytes, for ``DeviceLoader`` to copy to the device and convert there (``shardio.train.yuv_device``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from shardio.errors import ShardIntegrityError
from shardio.format.spec import HEADER_BYTES
from shardio.format.yuv_shard import parse_yuv_header, yuv420_to_rgb, yuv_sample_bytes

if TYPE_CHECKING:  # the snapshot imports this module, and the job's workers must not import torch
    import torch

try:  # the optional compiled extension (setup.py), shared with shardio.read.gather
    from shardio.read import _gather
except ImportError:
    _gather = None

__all__ = ["YuvPixels", "YuvPlanes", "map_yuv_shard", "convert_batch", "native", "simd"]

_REPAIR = "HINT: run `preprocess verify DIR --repair` to rebuild it from its input"


def native() -> bool:
    """Whether batches are converted by the compiled extension (else by numpy, the same bytes)."""
    return _gather is not None and hasattr(_gather, "yuv420_into")


def simd() -> str:
    """The native row conversion in use: ``avx2``, ``ssse3`` or ``scalar`` (checked at import; ``numpy``
    without the extension). ``SHARDIO_YUV_NO_AVX2`` / ``SHARDIO_YUV_NO_SIMD`` set at import step down."""
    return str(_gather.yuv420_simd()) if native() else "numpy"


class YuvPixels:
    """Samples ``first .. first + len`` of a yuv420 shard (``path``): its (N, S) uint8 planes (a memory map),
    converted to (H, W, 3) uint8 RGB on demand, H×W being the shard's own shape (its bucket's)."""

    dtype = np.dtype(np.uint8)

    def __init__(self, path: str, planes: np.ndarray, height: int, width: int, first: int = 0) -> None:
        self.path, self.planes, self.height, self.width, self.first = path, planes, height, width, first

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (len(self), self.height, self.width, 3)

    def __len__(self) -> int:
        return len(self.planes)

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step != 1:
                return self.convert()[index]
            return YuvPixels(self.path, self.planes[start:max(start, stop)], self.height, self.width,
                             self.first + start)
        if isinstance(index, (int, np.integer)):
            i = int(index) + (len(self) if index < 0 else 0)
            if not 0 <= i < len(self):
                raise IndexError(f"sample {index} of {len(self)}")
            return self[i:i + 1].convert()[0]
        return self.convert()[index]

    def with_plain_view(self) -> YuvPixels:
        """The same samples over a plain ndarray view of the planes' map (slicing a np.memmap costs ~3 µs more
        a piece; the view keeps the map open)."""
        return YuvPixels(self.path, np.asarray(self.planes), self.height, self.width, self.first)

    def convert(self, out: np.ndarray | None = None, threads: int = 1) -> np.ndarray:
        """Every sample as RGB, into ``out`` (N×H×W×3 uint8, C-contiguous) or a new array."""
        if out is None:
            out = np.empty(self.shape, np.uint8)
        convert_batch([self], out, threads)
        return out

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        pixels = self.convert()
        return pixels if dtype is None else pixels.astype(dtype)

    def __iter__(self) -> Iterator[np.ndarray]:
        return iter(self.convert())


def map_yuv_shard(path: str, local_path: str, samples: int, height: int, width: int) -> YuvPixels:
    """The yuv420 shard file at ``local_path`` (``path`` names it in errors) memory-mapped copy-on-write, its
    header checked against ``samples`` and H×W (ShardFormatError / ShardIntegrityError); its size is the
    caller's check (O(1), against the manifest's)."""
    with open(local_path, "rb") as f:
        count, sample_bytes = parse_yuv_header(f.read(HEADER_BYTES), path)
    expected = yuv_sample_bytes(height, width)
    if (count, sample_bytes) != (samples, expected):
        raise ShardIntegrityError(f"{path}: header says {count} samples of {sample_bytes} bytes, the manifest says "
                                  f"{samples} of {height}x{width} ({expected} bytes each): the index and the shard "
                                  f"disagree; {_REPAIR}")
    if samples == 0:
        return YuvPixels(path, np.empty((0, expected), np.uint8), height, width)
    planes = np.memmap(local_path, dtype=np.uint8, mode="c", offset=HEADER_BYTES, shape=(samples, expected))
    return YuvPixels(path, planes, height, width)


def convert_batch(pieces: Sequence[YuvPixels], out: np.ndarray, threads: int = 1) -> None:
    """The samples of ``pieces`` (slices of yuv420 shards of one shape), in order, converted to RGB into
    ``out`` (count×H×W×3 uint8, C-contiguous) on up to ``threads`` native threads, the GIL released."""
    if not pieces:
        return
    height, width = _one_shape(pieces)
    planes = [np.asarray(piece.planes) for piece in pieces]  # plain views: a np.memmap slice costs more
    if native():
        _gather.yuv420_into(planes, out, height, width, threads)
        return
    _convert_numpy(planes, out, height, width)


def _convert_numpy(planes: Sequence[np.ndarray], out: np.ndarray, height: int, width: int) -> None:
    """The fallback: what ``yuv420_into`` writes, and refuses, with numpy."""
    if not out.flags.c_contiguous or not out.flags.writeable:
        raise TypeError("yuv420_into: out must be a writable C-contiguous buffer")
    count = sum(len(rows) for rows in planes)
    if out.nbytes != count * height * width * 3:
        raise ValueError(f"yuv420_into: the pieces hold {count} samples of {height} x {width}, out {out.nbytes} bytes")
    target = out.reshape(count, height, width, 3)
    at = 0
    for rows in planes:
        yuv420_to_rgb(rows, height, width, out=target[at:at + len(rows)])
        at += len(rows)


def _one_shape(pieces: Sequence[YuvPixels]) -> tuple[int, int]:
    """(H, W) of ``pieces``; ValueError when they are not all of one shape (a batch is one bucket)."""
    shapes = {(piece.height, piece.width) for piece in pieces}
    if len(shapes) > 1:
        raise ValueError(f"a batch holds images of one shape; these pieces have {sorted(shapes)} (shards of "
                         f"different buckets: {pieces[0].path} and others)")
    return next(iter(shapes))


@dataclass(frozen=True)
class YuvPlanes:
    """One batch's images as their yuv420 planes, in batch order: ``planes`` is (B, S) uint8 (on the host, or
    on the device once moved), each row one H×W sample (``shardio.format.yuv_shard``). What
    ``ShardDataset(decode="device")`` puts in a yuv420 batch's ``image``; ``convert`` is the CPU conversion
    of the same bytes (``DeviceLoader`` converts on the device instead: ``shardio.train.yuv_device``)."""

    planes: torch.Tensor
    height: int
    width: int

    def __len__(self) -> int:
        return int(self.planes.shape[0])

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """The converted batch's shape: (B, H, W, 3)."""
        return (len(self), self.height, self.width, 3)

    def nbytes(self) -> int:
        """The planes' bytes (what a copy to the device moves: half a raw batch's at even sides)."""
        return int(self.planes.numel())

    def to(self, device: "torch.device | str", non_blocking: bool = False) -> YuvPlanes:
        """The same planes on ``device``."""
        return YuvPlanes(self.planes.to(device, non_blocking=non_blocking), self.height, self.width)

    def convert(self, out: np.ndarray | None = None, threads: int = 1) -> np.ndarray:
        """The batch converted on the CPU (as a converted batch is): uint8 (B, H, W, 3)."""
        host = self.planes.cpu().numpy()
        pixels = YuvPixels("batch", host, self.height, self.width)
        return pixels.convert(out, threads)

