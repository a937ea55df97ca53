"""Decode only the part of a drafted JPEG that the resize reads (the compiled ``_jpeg_region``).

A centre crop of a landscape photo keeps about two thirds of its columns; Pillow's ``load`` decodes all of
them. libjpeg-turbo can skip the inverse DCT, upsampling and colour conversion of columns and rows outside
a region (``jpeg_crop_scanline``, ``jpeg_skip_scanlines``); Huffman decoding of the whole file stays (it
cannot be skipped, and it is what finds truncated data). Measured on the bench corpus: ~5% of the decode.

Same pixels as Pillow's path: the decoder settings are Pillow's for a drafted JPEG (``_jpeg_region.c``),
the region lands at its place in an image of the full drafted size (so the resize takes the same box and
computes the same filter weights; shifting the box by the region's origin changed 0.15% of pixels by 1 in
some filter and size pairs), and it holds every pixel the filter reads plus a margin wider than an iMCU,
so the crop's edges (where fancy upsampling has no neighbour) never reach the output.
``tests/preprocess/image/test_jpeg_region.py`` compares both paths byte for byte over JPEG variants, modes and filters,
and over randomly damaged JPEGs. The end-of-data rule is the strict path's (``jpeg_markers``), decided more exactly:
libjpeg's "premature end of data segment" on the final EOI or a stray marker, not a probe of the suspended decoder.

Only sampling layouts proven to give Pillow's pixels take this path (``proven_layout``); the rest is decoded
by Pillow's load, same pixels, no region saved. Taken: grayscale, and 3 components whose chroma is 1x1 and
whose luma is 1x1 (4:4:4), 2x1 (4:2:2), 2x2 (4:2:0, nearly every web JPEG), 1x2 (4:4:0), 4x1 (4:1:1), 1x4,
3x1, 1x3, 3x2 or 2x3: ``tests/preprocess/image/test_jpeg_region_layouts.py`` compares them byte for byte with Pillow's
path, baseline, progressive and with restart markers, at draft scales 1, 2, 4, 8 and crops of either side.
Falling back: luma 2x4 and 4x2, where libjpeg-turbo 2.1.5's ``jpeg_crop_scanline`` returns wrong pixels
(max |diff| 255 at 1/2 and 1/4 with columns cropped; its own ``djpeg -scale 1/2 -crop`` does the same) and
``jpeg_skip_scanlines`` mis-skips (a valid baseline file refused as cut, a progressive one never returned);
subsampled or mixed chroma (``-sample 2x2,1x2,1x1``); CMYK; arithmetic coding.

Optional: without the compiled module (a machine that built the package without libjpeg headers)
``available()`` is False and ``transform`` decodes with Pillow as before, same pixels, slower.
"""

from __future__ import annotations

import math

from PIL import Image

from preprocess.image.jpeg_markers import JpegLayout

try:
    from preprocess.image._jpeg_region import decode_region as _decode_region
except ImportError:  # not built: see the module docstring
    _decode_region = None

__all__ = ["available", "applies", "plain", "proven_layout", "draft_scale", "decode", "MARGIN", "PROVEN_LUMA"]

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

# Luma sampling factors (h, v) of 3-component JPEGs with 1x1 chroma that the region decoder is proven on
# (see the module docstring): every layout libjpeg accepts (h * v + 2 blocks <= 10 a MCU) but 2x4 and 4x2.
PROVEN_LUMA = frozenset({(1, 1), (2, 1), (1, 2), (2, 2), (3, 1), (1, 3), (4, 1), (1, 4), (3, 2), (2, 3)})


def available() -> bool:
    return _decode_region is not None


def applies(im: Image.Image, layout: JpegLayout | None) -> bool:
    """Whether ``im`` (opened by Pillow, drafted, not loaded) is a JPEG the region decoder gives Pillow's
    pixels for: one Huffman-coded frame at the start of the data, decoded to L or RGB (not CMYK)."""
    if _decode_region is None or layout is None or not layout.huffman or not proven_layout(layout):
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
            and layout.components in (1, 3) and layout.width > 0 and layout.height > 0 and proven_layout(layout))


def proven_layout(layout: JpegLayout) -> bool:
    """Whether the region decoder is proven to give Pillow's pixels for this sampling layout: grayscale,
    or 3 components with 1x1 chroma and a luma in ``PROVEN_LUMA`` (the module docstring says why)."""
    sampling = layout.sampling
    if len(sampling) == 1:
        return True  # one component: libjpeg decodes it non-interleaved, one block a MCU, whatever its factors
    return len(sampling) == 3 and sampling[0] in PROVEN_LUMA and sampling[1] == sampling[2] == (1, 1)


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
