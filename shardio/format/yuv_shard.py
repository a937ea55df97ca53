"""Half-size raw shards (``encoding: yuv420``, format version 5): the layout, its header, its O(1) size, and
the colour conversion both ways, in numpy (the equations are the spec; a reader's native conversion,
``shardio.read.yuv_pixels``, gives the same bytes).

One file per shard, ``shards/NAME.yuv.npy``, beside the same ``.jsonl`` as a raw shard::

    offset 0      128-byte .npy v1.0 header of a uint8 array of shape (N, S)
                  (``{'descr': '|u1', 'fortran_order': False, 'shape': (N, S), }``, padded as a raw shard's)
    offset 128    sample 0's planes, S bytes, then sample 1's, ... : row i of the array is sample i
    file size     128 + N * S

where, for images of H×W (the bucket's h×w in a bucketed dataset) and CH = ceil(H/2), CW = ceil(W/2)::

    S = H*W + 2*CH*CW          (1.5 bytes a pixel for even sides: 98,304 bytes at 256², raw 196,608)
    row[0 : H*W]               Y,  H×W, row-major
    row[H*W : H*W + CH*CW]     Cb, CH×CW, row-major
    row[H*W + CH*CW : S]       Cr, CH×CW, row-major

So ``np.load(path, mmap_mode="r")`` maps it with numpy alone, a batch of consecutive samples is a slice
of the map (as for a raw shard), and a truncated or overwritten shard is caught by one ``stat``: its
exact size follows from N, H and W.

Colour (full-range BT.601, the JFIF equations JPEG uses; R, G, B, Y, Cb, Cr in 0..255)::

    Y  =  0.299 R + 0.587 G + 0.114 B
    Cb = -0.168736 R - 0.331264 G + 0.5 B + 128
    Cr =  0.5 R - 0.418688 G - 0.081312 B + 128

    R = Y + 1.402 (Cr - 128)
    G = Y - 0.344136 (Cb - 128) - 0.714136 (Cr - 128)
    B = Y + 1.772 (Cb - 128)

Chroma is subsampled by the mean of each 2×2 block (a block past an odd edge holds the pixels inside the
image: its mean over them), rounded once (the mean of the exact Cb, not of rounded ones; libjpeg rounds each
pixel's first). Written with libjpeg's 16-bit fixed-point constants (``rgb_to_yuv420``): every value is
the real equation's, rounded, off by at most 1. Read back with each chroma sample repeated over its 2×2
block (nearest upsampling) and libjpeg's fixed-point inverse (``yuv420_to_rgb``), clamped to 0..255: within
1 of the exact inverse of the stored planes (the tests measure it).

Why nearest and not libjpeg's "fancy" (bilinear, 3/4 + 1/4) upsampling: on photo-like images at 256² (the
bench's LAION-like originals through the job's transform) yuv420 against the raw pixels has a median PSNR
of 45.9 dB with nearest and 47.2 dB with fancy, both well above JPEG q90 4:4:4's ~42 dB; nearest costs no
neighbour reads (each chroma offset is computed once per 2×2 block and added to four Y values), so the CPU
conversion keeps up with a raw shard's copy and the device conversion is a view and an add
(``python -m bench.yuv_reader`` measures both).
"""

from __future__ import annotations


import numpy as np

from shardio.errors import ShardFormatError
from shardio.format.raw_shard import fixed_npy_header, npy_header_fields
from shardio.format.spec import HEADER_BYTES

__all__ = ["YUV_SUFFIX", "yuv_sample_bytes", "chroma_shape", "yuv_header", "yuv_shard_nbytes", "parse_yuv_header",
           "split_planes", "rgb_to_yuv420", "yuv420_to_rgb", "chroma_offsets"]

YUV_SUFFIX = ".yuv.npy"

# libjpeg's fixed-point constants (jccolor.c, jdcolor.c): FIX(x) = round(x * 2**16).
_ONE_HALF = 1 << 15
_FIX_Y = (19595, 38470, 7471)            # 0.29900, 0.58700, 0.11400 (sum 65536: Y stays <= 255)
_FIX_CB = (-11059, -21709, 32768)        # -0.16874, -0.33126, 0.5
_FIX_CR = (32768, -27439, -5329)         # 0.5, -0.41869, -0.08131
FIX_CR_R, FIX_CB_B = 91881, 116130       # 1.40200, 1.77200
FIX_CB_G, FIX_CR_G = -22554, -46802      # -0.34414, -0.71414


def chroma_shape(height: int, width: int) -> tuple[int, int]:
    """(CH, CW) of a chroma plane of an H×W image: each side halved, rounded up."""
    return (height + 1) // 2, (width + 1) // 2


def yuv_sample_bytes(height: int, width: int) -> int:
    """S: the bytes of one H×W sample's three planes."""
    chroma_h, chroma_w = chroma_shape(height, width)
    return height * width + 2 * chroma_h * chroma_w


def yuv_header(count: int, height: int, width: int) -> bytes:
    """The fixed 128-byte .npy v1.0 header of a yuv420 shard of ``count`` H×W samples: shape (N, S)."""
    return fixed_npy_header("|u1", (count, yuv_sample_bytes(height, width)))


def yuv_shard_nbytes(count: int, height: int, width: int) -> int:
    """The exact size of a yuv420 shard of ``count`` H×W samples: the header and the planes."""
    return HEADER_BYTES + count * yuv_sample_bytes(height, width)


def parse_yuv_header(header: bytes, path: str) -> tuple[int, int]:
    """(N, S) from a yuv420 shard's first 128 bytes, or ShardFormatError saying what is wrong with them."""
    meta = npy_header_fields(header, path, "a shardio yuv420 shard", "the file is corrupt - run `preprocess verify "
                             "DIR --repair`", "yuv420 shard header")
    shape = meta["shape"]
    ok = meta["descr"] == "|u1" and not meta["fortran_order"] and len(shape) == 2
    if not ok:
        raise ShardFormatError(f"{path}: header describes {meta!r}, expected the uint8 (N, S) planes of a yuv420 "
                               "shard (is this a raw shard in a dataset whose config says encoding: yuv420?)")
    return int(shape[0]), int(shape[1])


def split_planes(planes: np.ndarray, height: int, width: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Views of the Y (..., H, W), Cb and Cr (..., CH, CW) planes of one sample's row (S,) or rows (N, S)."""
    chroma_h, chroma_w = chroma_shape(height, width)
    lead = planes.shape[:-1]
    luma, chroma = height * width, chroma_h * chroma_w
    y = planes[..., :luma].reshape(*lead, height, width)
    cb = planes[..., luma:luma + chroma].reshape(*lead, chroma_h, chroma_w)
    cr = planes[..., luma + chroma:luma + 2 * chroma].reshape(*lead, chroma_h, chroma_w)
    return y, cb, cr


def rgb_to_yuv420(rgb: np.ndarray) -> np.ndarray:
    """One H×W×3 uint8 image as its planes (S,) uint8: what a yuv420 shard stores for it (``split_planes``
    gives the three planes back)."""
    if rgb.ndim != 3 or rgb.shape[2] != 3 or rgb.dtype != np.uint8:
        raise ValueError(f"image {rgb.shape} {rgb.dtype} is not H×W×3 uint8")
    height, width = rgb.shape[:2]
    chroma_h, chroma_w = chroma_shape(height, width)
    channels = rgb.astype(np.int32)
    red, green, blue = channels[..., 0], channels[..., 1], channels[..., 2]
    out = np.empty(yuv_sample_bytes(height, width), np.uint8)
    y, cb, cr = split_planes(out, height, width)
    y[...] = (_FIX_Y[0] * red + _FIX_Y[1] * green + _FIX_Y[2] * blue + _ONE_HALF) >> 16
    # An odd side's last row/column counted twice: a block's mean over the pixels inside the image.
    rows = np.minimum(np.arange(2 * chroma_h), height - 1)
    cols = np.minimum(np.arange(2 * chroma_w), width - 1)
    for plane, fix in ((cb, _FIX_CB), (cr, _FIX_CR)):
        full = fix[0] * red + fix[1] * green + fix[2] * blue  # x 2**16, no offset, no rounding yet
        blocks = full[rows][:, cols].reshape(chroma_h, 2, chroma_w, 2).sum(axis=(1, 3), dtype=np.int64)
        # round(sum / 4 / 2**16 + 128): the +128 and the half as one bias, an arithmetic shift by 18
        plane[...] = np.clip((blocks + (257 << 17)) >> 18, 0, 255)
    return out


def chroma_offsets(cb: np.ndarray, cr: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """What each chroma sample adds to its block's Y for R, G and B (int32, libjpeg's fixed point, floor
    division by 2**16 as an arithmetic shift): the one place the inverse's constants are applied."""
    x_cb = cb.astype(np.int32) - 128
    x_cr = cr.astype(np.int32) - 128
    red = (FIX_CR_R * x_cr + _ONE_HALF) >> 16
    green = (FIX_CB_G * x_cb + FIX_CR_G * x_cr + _ONE_HALF) >> 16
    blue = (FIX_CB_B * x_cb + _ONE_HALF) >> 16
    return red, green, blue


def yuv420_to_rgb(planes: np.ndarray, height: int, width: int, out: np.ndarray | None = None) -> np.ndarray:
    """Samples' planes (N, S) uint8 (or one sample's (S,)) as RGB uint8 (N, H, W, 3) (or (H, W, 3)), into
    ``out`` when given: nearest upsampling of chroma, libjpeg's fixed-point inverse, clamped. The reader's
    fallback where its native conversion is not built, byte for byte the same."""
    single = planes.ndim == 1
    rows = planes.reshape(1, -1) if single else planes
    if rows.shape[-1] != yuv_sample_bytes(height, width):
        raise ValueError(f"planes of {rows.shape[-1]} bytes a sample; {height}x{width} takes "
                         f"{yuv_sample_bytes(height, width)}")
    if out is None:
        out = np.empty((len(rows), height, width, 3) if not single else (height, width, 3), np.uint8)
    target = out.reshape(len(rows), height, width, 3)
    y, cb, cr = split_planes(rows, height, width)
    for number in range(len(rows)):  # one sample at a time: the int32 temporaries stay a sample's size
        luma = y[number].astype(np.int16)
        for channel, offset in enumerate(chroma_offsets(cb[number], cr[number])):
            full = offset.astype(np.int16).repeat(2, axis=0).repeat(2, axis=1)[:height, :width]
            np.clip(luma + full, 0, 255, out=full)
            target[number, :, :, channel] = full
    return out
