"""Decode only the part of a drafted JPEG that the resize reads (the compiled ``_jpeg_region``).

A centre crop of a landscape photo keeps about two thirds of its columns; Pillow's ``load`` decodes all of
them. libjpeg-turbo can skip the inverse DCT, upsampling and colour conversion of columns and rows outside
a region (``jpeg_crop_scanline``, ``jpeg_skip_scanlines``); Huffman decoding of the whole file stays (it
cannot be skipped, and it is what finds truncated data). Measured on the bench corpus: ~5% of the decode.

Same pixels as Pillow's path: the decoder settings are Pillow's for a drafted JPEG (``_jpeg_region.c``),
the region lands at its place in an image of the full drafted size (so the resize takes the same box and
computes the same filter weights; shifting the box by the region's origin changed 0.15% of pixels by 1 in
some filter and size pairs), and it holds every pixel the filter reads plus a margin wider than an iMCU,
so the crop's edges (where fancy upsampling has no neighbour) never reach the output. ``tests/test_jpeg_region.py``
compares both paths byte for byte over JPEG variants, modes and filters.

Optional: without the compiled module (a machine that built the package without libjpeg headers)
``available()`` is False and ``transform`` decodes with Pillow as before, same pixels, slower.
"""

from __future__ import annotations

import math
from typing import Any

from PIL import Image

from preprocess.jpeg_markers import JpegLayout

try:
    from preprocess._jpeg_region import decode_region as _decode_region
except ImportError:  # not built: see the module docstring
    _decode_region = None

__all__ = ["available", "applies", "decode", "MARGIN"]

# Decoded pixels kept beyond the filter's reach on each side: more than one iMCU (16 columns or rows at
# scale 1, fewer when drafted), where a cropped decode's fancy upsampling differs from a full one.
MARGIN = 18
# Pillow's filter supports (Resample.c), in output pixels; scaled by the downscaling factor.
_SUPPORT = {
    Image.Resampling.NEAREST: 1.0,
    Image.Resampling.BOX: 0.5,
    Image.Resampling.BILINEAR: 1.0,
    Image.Resampling.HAMMING: 1.0,
    Image.Resampling.BICUBIC: 2.0,
    Image.Resampling.LANCZOS: 3.0,
}


def available() -> bool:
    return _decode_region is not None


def applies(im: Image.Image, layout: JpegLayout | None) -> bool:
    """Whether ``im`` (opened, drafted, not loaded) is a JPEG the region decoder gives Pillow's pixels for:
    one Huffman-coded frame at the start of the data, decoded to L or RGB (not CMYK)."""
    if _decode_region is None or layout is None or not layout.huffman:
        return False
    if len(im.tile) != 1 or im.mode not in ("RGB", "L"):
        return False
    tile = im.tile[0]
    return tile.codec_name == "jpeg" and tile.offset == 0 and isinstance(tile.args, tuple) and \
        tile.args[0] == im.mode


def decode(
    im: Image.Image, data: bytes, layout: JpegLayout, box: tuple[float, float, float, float],
    out_size: tuple[int, int], resample: int,
) -> Image.Image:
    """Decode the part of ``im`` that resizing ``box`` (decoded coordinates) to ``out_size`` reads.

    Returns an RGBX image of ``im``'s drafted size, sharing the decoder's buffer, in which only that part
    holds pixels: resize it with the same ``box``. Raises ``ScanDataEnded`` for data cut inside a scan and
    ``OSError`` with libjpeg's message for anything else wrong with the data.
    """
    assert _decode_region is not None
    config: Any = im.decoderconfig
    scale = int(config[0]) if config else 1
    left, top, right, bottom = box
    reach_x = _reach(right - left, out_size[0], resample)
    reach_y = _reach(bottom - top, out_size[1], resample)
    x0 = max(0, math.floor(left - reach_x))
    y0 = max(0, math.floor(top - reach_y))
    x1 = min(im.width, math.ceil(right + reach_x))
    y1 = min(im.height, math.ceil(bottom + reach_y))
    end = layout.eoi if layout.eoi is not None else len(data)
    pixels, width, height, *_ = _decode_region(data, end, scale, im.width, im.height, x0, x1, y0, y1)
    return Image.frombuffer("RGBX", (width, height), pixels, "raw", "RGBX", 0, 1)


def _reach(extent: float, size: int, resample: int) -> float:
    """How far past the box's edge the filter reads, in decoded pixels, plus the margin."""
    return _SUPPORT.get(resample, 3.0) * max(1.0, extent / size) + 1 + MARGIN
