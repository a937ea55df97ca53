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
compares both paths byte for byte over JPEG variants, modes and filters, and over randomly damaged JPEGs.
The end-of-data rule is the strict path's (``jpeg_markers``), decided more exactly: libjpeg's "premature end
of data segment" on the final EOI, not a probe of the suspended decoder.

Optional: without the compiled module (a machine that built the package without libjpeg headers)
``available()`` is False and ``transform`` decodes with Pillow as before, same pixels, slower.
"""

from __future__ import annotations

import math

from PIL import Image

from preprocess.jpeg_markers import JpegLayout

try:
    from preprocess._jpeg_region import decode_region as _decode_region
except ImportError:  # not built: see the module docstring
    _decode_region = None

__all__ = ["available", "applies", "plain", "draft_scale", "decode", "MARGIN"]

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
    """Whether ``im`` (opened by Pillow, drafted, not loaded) is a JPEG the region decoder gives Pillow's
    pixels for: one Huffman-coded frame at the start of the data, decoded to L or RGB (not CMYK)."""
    if _decode_region is None or layout is None or not layout.huffman:
        return False
    if len(im.tile) != 1 or im.mode not in ("RGB", "L"):
        return False
    tile = im.tile[0]
    return tile.codec_name == "jpeg" and tile.offset == 0 and isinstance(tile.args, tuple) and \
        tile.args[0] == im.mode


def plain(layout: JpegLayout | None) -> bool:
    """Whether ``transform`` can take this JPEG from its marker layout alone, never opening it with Pillow:
    a plain header (``JpegLayout.plain_header``) over one Huffman-coded L or RGB frame of a sane size."""
    return (_decode_region is not None and layout is not None and layout.plain_header and layout.huffman
            and layout.components in (1, 3) and layout.width > 0 and layout.height > 0)


def draft_scale(size: tuple[int, int], request: tuple[int, int]) -> int:
    """The DCT scale Pillow's ``JpegImageFile.draft`` picks for ``request``: the largest of 8, 4, 2, 1
    not above ``min(width // request width, height // request height)``."""
    scale = min(size[0] // request[0], size[1] // request[1])
    return next(s for s in (8, 4, 2, 1) if scale >= s or s == 1)


def decode(
    data: bytes, layout: JpegLayout, scale: int, size: tuple[int, int],
    box: tuple[float, float, float, float], out_size: tuple[int, int], resample: int,
) -> Image.Image:
    """Decode, at 1/``scale`` (``size``: the scaled size), the part of the JPEG that resizing ``box``
    (scaled coordinates) to ``out_size`` reads.

    Returns an RGBX image of ``size``, sharing the decoder's buffer, in which only that part holds pixels:
    resize it with the same ``box``. Raises ``ScanDataEnded`` for data cut inside a scan, ``OSError`` with
    libjpeg's message for anything else wrong with the data, ``ValueError`` if libjpeg reads another size.
    """
    assert _decode_region is not None
    width, height = size
    left, top, right, bottom = box
    reach_x = _reach(right - left, out_size[0], resample)
    reach_y = _reach(bottom - top, out_size[1], resample)
    x0 = max(0, math.floor(left - reach_x))
    y0 = max(0, math.floor(top - reach_y))
    x1 = min(width, math.ceil(right + reach_x))
    y1 = min(height, math.ceil(bottom + reach_y))
    end = layout.eoi if layout.eoi is not None else len(data)
    pixels, *_ = _decode_region(data, end, scale, width, height, x0, x1, y0, y1)
    return Image.frombuffer("RGBX", size, pixels, "raw", "RGBX", 0, 1)


def _reach(extent: float, size: int, resample: int) -> float:
    """How far past the box's edge the filter reads, in decoded pixels, plus the margin."""
    return _SUPPORT.get(resample, 3.0) * max(1.0, extent / size) + 1 + MARGIN
