"""JPEG shards (``encoding: jpeg``, format version 3): the layout, its header, and its O(1) checks.

One file per shard, ``shards/NAME.jpg.npy``, beside the same ``.jsonl`` as a raw shard::

    offset 0                  128-byte .npy v1.0 header of a little-endian uint64 array of shape (N + 1,)
                              (``{'descr': '<u8', 'fortran_order': False, 'shape': (N+1,), }``, padded)
    offset 128                offsets: N + 1 uint64, offsets[0] = 0, non-decreasing
    offset 128 + 8 (N + 1)    the N JPEGs, concatenated: sample i is data[offsets[i]:offsets[i + 1]]
    file size                 128 + 8 (N + 1) + offsets[N]

So ``np.load(path, mmap_mode="r")`` gives the offsets with numpy alone (numpy reads the array and ignores
what follows), ``np.memmap(path, np.uint8, "r", offset=128 + 8 * (N + 1))`` the data, and each sample is a
standard baseline JFIF of exactly H×W pixels (its bucket's h×w in a bucketed dataset: ``shardio.format``,
"Buckets"), 3 components (``PIL.Image.open`` or ``djpeg`` read it). The
header gives N, the last offset the data's size: a truncated shard is caught by one ``stat`` plus one
8-byte read, and the manifest's ``bytes`` is the whole file's size as for a raw shard. The JPEGs' quality
and chroma subsampling are the dataset's config (``quality``, ``subsampling``), stored in the manifest.

Why one file and offsets first: the manifest entry keeps its fields (one file, one checksum, one size:
nothing changes for generations, retention, object storage or verify), sample i is two reads of the
offsets, and the writer holds one shard's JPEGs (~23 KB each at 256², 23 MB for 1,000) until commit.
"""

from __future__ import annotations


import numpy as np

from shardio.errors import ShardFormatError, ShardIntegrityError
from shardio.format.raw_shard import fixed_npy_header, npy_header_fields
from shardio.format.spec import HEADER_BYTES

__all__ = ["JPEG_SUFFIX", "jpeg_header", "jpeg_data_start", "jpeg_min_bytes", "parse_jpeg_header",
           "check_offsets", "jpeg_frame_size"]

JPEG_SUFFIX = ".jpg.npy"


def jpeg_header(count: int) -> bytes:
    """The 128-byte .npy header of a JPEG shard of ``count`` samples (its N + 1 offsets)."""
    return fixed_npy_header("<u8", (count + 1,))


def jpeg_data_start(count: int) -> int:
    """Where the JPEG bytes of a shard of ``count`` samples begin."""
    return HEADER_BYTES + 8 * (count + 1)


def jpeg_min_bytes(count: int) -> int:
    """The smallest a JPEG shard of ``count`` samples can be (every JPEG empty): header + offsets."""
    return jpeg_data_start(count)


def parse_jpeg_header(header: bytes, path: str) -> int:
    """N from a JPEG shard's first 128 bytes, or ShardFormatError saying what is wrong with them."""
    meta = npy_header_fields(header, path, "a shardio JPEG shard", "the file is corrupt - run `preprocess verify DIR "
                             "--repair`", "JPEG shard header")
    shape = meta["shape"]
    ok = meta["descr"] == "<u8" and not meta["fortran_order"] and len(shape) == 1 and shape[0] >= 1
    if not ok:
        raise ShardFormatError(f"{path}: header describes {meta!r}, expected the uint64 offsets (N+1,) of a "
                               "JPEG shard (is this a raw shard in a dataset whose config says encoding: jpeg?)")
    return int(shape[0]) - 1


def check_offsets(offsets: np.ndarray, file_bytes: int, path: str) -> None:
    """ShardIntegrityError naming the shard and sample when the offsets do not describe its data: the
    first is 0, none decreases, the last ends the file (vectorised: ~1 µs per 1,000 samples)."""
    count = len(offsets) - 1
    data_bytes = file_bytes - jpeg_data_start(count)
    if offsets[0] != 0:
        raise ShardIntegrityError(f"{path}: offsets[0] is {int(offsets[0])}, not 0 (corrupt offsets)")
    steps = np.diff(offsets.astype(np.int64))
    if (steps < 0).any():
        sample = int(np.argmax(steps < 0))
        raise ShardIntegrityError(f"{path}: sample {sample}: offsets decrease (corrupt offsets)")
    if int(offsets[-1]) != data_bytes:
        raise ShardIntegrityError(
            f"{path}: the offsets end at {int(offsets[-1])} data bytes, the file holds {data_bytes} "
            "(truncated or overwritten); HINT: run `preprocess verify DIR --repair`")


# Start-of-frame markers (ITU T.81, table B.1): 0xC0..0xCF but DHT (C4), JPG (C8) and DAC (CC).
_SOF_MARKERS = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}


def jpeg_frame_size(jpeg: bytes | memoryview) -> tuple[int, int] | None:
    """``(height, width)`` from a JPEG's frame header (its SOF segment), read by walking the segments before
    it (a few hundred bytes for the writer's JPEGs: APP0, DQT, SOF0), no decode; None when there is none
    before the scan (not a JPEG, or cut short). ``verify`` checks a JPEG shard's first image against its
    bucket with it."""
    data = bytes(jpeg[:2])
    if data != b"\xff\xd8":
        return None
    at = 2
    while at + 4 <= len(jpeg):
        if jpeg[at] != 0xFF:
            return None
        marker = jpeg[at + 1]
        if marker == 0xFF:  # fill byte
            at += 1
            continue
        if marker == 0x01 or 0xD0 <= marker <= 0xD7:  # standalone markers: no length
            at += 2
            continue
        if marker in (0xD9, 0xDA):  # end of image, start of scan: no frame header before it
            return None
        length = int.from_bytes(bytes(jpeg[at + 2:at + 4]), "big")
        if marker in _SOF_MARKERS:
            frame = bytes(jpeg[at + 5:at + 9])
            if len(frame) < 4:
                return None
            return int.from_bytes(frame[:2], "big"), int.from_bytes(frame[2:], "big")
        at += 2 + length
    return None
