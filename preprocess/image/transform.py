"""One encoded image (bytes) -> one H×W×3 uint8 array, as fast as the JPEG decoder allows.

The order of work is chosen for speed (one core, 1.7 MP JPEG -> 256²; ``python -m bench.run`` measures the paths):
full decode 5.7 ms, but ``draft`` (libjpeg-turbo DCT scaling) decodes at 1/2, 1/4 or 1/8 size for
~3.5 ms, and resizing only the kept region with ``resize(box=...)`` skips a separate crop. EXIF
orientation is folded in: the draft/resize target is swapped for orientations 5-8 and the small output is
transposed, never the large input.
What the resize keeps and where it puts the pixels is the mode's row (``preprocess.image.resize_modes``), looked
up once per image.

Every failure of an untrusted image becomes a ``SampleError``: a code (``shardio.failure_reasons``) and a
short reason; the job counts it and goes on. ``LOAD_TRUNCATED_IMAGES`` is never set: a truncated JPEG is an
error, not a grey bottom half.
Each image is decoded by exactly one ``load()``: a second load after a failed one returns Pillow's partial
pixels without an error (a PNG's eXIf chunk may follow its pixels, so non-JPEG orientation is read after it).
The pixel-bomb limit is checked on the header's size, before any decoding; Pillow's process-wide
``MAX_IMAGE_PIXELS`` is set to ``max_image_pixels`` so its own check neither loosens nor tightens it.

Limits per image, each a counted failure (config keys): ``min_image_size`` and ``max_aspect_ratio`` on the
header's size; ``max_jpeg_scans`` on the SOS markers counted in the bytes; ``max_decoded_bytes`` on the
decoded size and mode (after draft) with the conversions to RGB, plus the DCT coefficients libjpeg keeps
for a multi-scan (progressive) JPEG, before decoding; ``max_decode_seconds`` after the fact (one C call
cannot be interrupted; the other limits keep such calls short, and in a Ray task
``preprocess.image.decode_watch`` ends a decode that runs past 2 x the limit + 1 s).

JPEG data must be complete, though libjpeg only warns when it is not: a JPEG cut mid-scan with an EOI
appended, or whose header claims more pixels than its data holds, would come out grey-filled. It is
decoded by ``jpeg_markers.use_strict_decoder`` (Pillow's decoder, the EOI held back: same pixels, no
second decode) and its scans must bring every component to full precision. A stray marker inside a scan
(``FF 01``; libjpeg stops the scan there and skips what follows) ends the data the same way. Not caught
(libjpeg warns, the pixels are damaged locally): corruption inside the data that resynchronises at the
next restart marker or segment. Bytes after the EOI (common on the web)
are ignored, as libjpeg does, and a missing EOI after complete scans is accepted.
"""

from __future__ import annotations

import io
import math
import re
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
from PIL import Image, ImageFile, TiffImagePlugin, UnidentifiedImageError, features

from preprocess.image import jpeg_region
from preprocess.config import JobConfig
from preprocess.image.jpeg_markers import JpegLayout, ScanDataEnded, jpeg_layout, use_strict_decoder
from preprocess.image.resize_modes import ResizeMode, resize_mode
from shardio.errors import SampleError
from shardio.failure_reasons import FailureCode

__all__ = ["ProcessedImage", "process_image", "ALLOWED_FORMATS"]

# Routed by detected content, never by file extension. Cameras' multi-picture JPEGs (MPO) open as JPEG.
ALLOWED_FORMATS = ("JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF")
_JPEG_FORMATS = ("JPEG", "MPO")
_JPEG_MODES = {1: "L", 3: "RGB"}  # Pillow's mode for a JPEG of 1 or 3 components
Image.init()  # register every plugin now: Image.open(formats=...) fails on names only a full init loads
_EXIF_ORIENTATION = 0x0112
# EXIF orientation -> the transpose that displays the stored image upright (as ImageOps.exif_transpose).
_TRANSPOSE = {
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_270,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_90,
}
# Without libtiff (make install builds Pillow-SIMD without it), Pillow decodes uncompressed TIFF only:
# deflate, LZW, JPEG... would fail with "decoder libtiff not available". Refused by name instead.
_TIFF_CODECS = None if features.check("libtiff") else ("raw",)
# Pillow converts Lab (CIELAB TIFFs, from lab and print workflows) to RGB through ImageCms, which needs
# littleCMS; a build without it fails with "cannot import name '_imagingcms'". Said as what it is instead.
_HAS_LITTLECMS = bool(features.check("littlecms2"))
_TIFF_MAGIC = (b"II*\x00", b"MM\x00*", b"II+\x00", b"MM\x00+")  # classic and BigTIFF, both byte orders
_PHOTOMETRIC = {0: "white-is-zero grey", 1: "grey", 2: "RGB", 3: "palette", 4: "mask", 5: "separated (CMYK)",
                6: "YCbCr", 8: "CIELab", 9: "ICCLab", 10: "ITULab", 32844: "LogL", 32845: "LogLuv"}
_EXTRA_SAMPLES = {0: "unspecified", 1: "associated alpha", 2: "unassociated alpha"}
# Peak bytes a pixel while an image is decoded and converted to RGB by ``_to_rgb``. Pillow keeps 1 byte a
# pixel for 1/L/P, 2 for I;16*, 4 for every other mode (RGB included); the conversions add their copies:
# RGBA: rgba copy 4 + alpha 1 + canvas 4; a colour key goes through RGBA first (+4); 16-bit and float
# samples go through numpy (int64 / float32 temporaries); the rest convert to RGB once (+4).
_DECODED_BYTES = {"1": 1, "L": 1, "P": 1, "I;16": 2, "I;16B": 2, "I;16L": 2, "I;16N": 2}
_CONVERSION_BYTES = {"RGB": 0, "1": 4, "L": 4, "P": 4, "RGBA": 9, "RGBa": 9, "LA": 9, "La": 9, "PA": 9,
                     "I": 32, "I;16": 32, "I;16B": 32, "I;16L": 32, "I;16N": 32, "F": 24}
_KEYED_EXTRA_BYTES = 4 + 9  # P/L/RGB/1 with a tRNS colour key: to RGBA, then the RGBA path
_SCAN_ENDS_EARLY = ("JPEG scan data ends early (cut mid-scan with an EOI appended, interrupted by a stray marker,"
                    " or a header claiming more pixels than the data holds; libjpeg would fill the rest with grey)")
_PILLOW_BOMB_PIXELS = re.compile(r"\((\d+) pixels\)")
_PILLOW_TRUNCATED = ("image file is truncated", "Truncated File Read")  # see _decoder_failure_code
# A box edge: whole pixels (a pad box), or a fractional region of a draft (the kept box in source pixels).
Coordinate = TypeVar("Coordinate", int, float)
_RESAMPLE = {
    "nearest": Image.Resampling.NEAREST,
    "box": Image.Resampling.BOX,
    "bilinear": Image.Resampling.BILINEAR,
    "hamming": Image.Resampling.HAMMING,
    "bicubic": Image.Resampling.BICUBIC,
    "lanczos": Image.Resampling.LANCZOS,
}


@dataclass
class ProcessedImage:
    pixels: np.ndarray  # (height, width, 3) uint8
    width: int  # original size, upright (after EXIF orientation)
    height: int
    format: str
    mode: str  # the decoded mode before conversion to RGB
    draft_scale: int  # 1, 2, 4 or 8: the DCT scale the decoder used
    upscaled: bool = False  # the kept region was smaller than the target on a side: pixels were invented
    # ``mode: pad`` only: (x0, y0, x1, y1), end-exclusive, of the output pixels that hold the picture (the
    # rest is ``fill``); stored as the ``.jsonl`` line's ``box`` (shardio.format). None in other modes.
    content_box: tuple[int, int, int, int] | None = None
    # ``mode: bucket``: the id (index into ``cfg.buckets``) of the bucket whose shape ``pixels`` has; 0 else.
    bucket: int = 0
    # (top, left): the source pixels the centre crop cut above and left of what ``pixels`` shows, in the
    # upright source (``width`` x ``height``); (0, 0) where nothing is cut (pad, stretch). Stored as the
    # ``.jsonl`` line's ``crop`` in the modes that crop (shardio.format); SDXL's ``crops_coords_top_left``.
    crop_top_left: tuple[int, int] = (0, 0)


def _open(data: bytes, cfg: JobConfig) -> Image.Image:
    if not data:
        raise SampleError(FailureCode.EMPTY_MEMBER, "empty image member (0 bytes)")
    Image.MAX_IMAGE_PIXELS = cfg.max_image_pixels  # one job config per worker process
    with warnings.catch_warnings():
        # Pillow's other warnings ("Corrupt EXIF data" while reading a JPEG's dpi) must not fail an image
        # under -W error. It only warns between MAX_IMAGE_PIXELS and twice that; that band is an error here.
        warnings.simplefilter("ignore")
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        try:
            im = Image.open(io.BytesIO(data), formats=ALLOWED_FORMATS)
        except UnidentifiedImageError:
            code, sniffed = _sniff(data)
            raise SampleError(code, f"not a supported image ({sniffed}, {len(data)} bytes)") from None
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
            # Pillow's message quotes its error threshold, twice the configured limit: name ours.
            found = _PILLOW_BOMB_PIXELS.search(str(e))
            pixels = f"{int(found.group(1))} pixels" if found else "more pixels"
            raise SampleError(FailureCode.TOO_MANY_PIXELS,
                              f"pixel bomb: {pixels} > max_image_pixels {cfg.max_image_pixels}") from None
    width, height = im.size
    if width < 1 or height < 1:
        raise SampleError(FailureCode.EMPTY_SIZE, f"{im.format} with an empty size {width}x{height}")
    if width * height > cfg.max_image_pixels:
        raise SampleError(
            FailureCode.TOO_MANY_PIXELS,
            f"pixel bomb: {width}x{height} = {width * height} pixels"
            f" > max_image_pixels {cfg.max_image_pixels}"
        )
    _check_shape(width, height, cfg)
    compression = im.info.get("compression", "raw") if im.format == "TIFF" else None
    if compression is not None and _TIFF_CODECS is not None and compression not in _TIFF_CODECS:
        raise SampleError(FailureCode.UNSUPPORTED_FORMAT,
                          f"TIFF compression not supported ({compression}: this Pillow build has no libtiff,"
                          " only uncompressed TIFF is decoded)")
    if im.mode == "LAB" and not _HAS_LITTLECMS:
        raise SampleError(FailureCode.UNSUPPORTED_COLOUR,
                          f"{im.format} in Lab colour (CIELAB): converting Lab to RGB needs Pillow's littleCMS "
                          "support (ImageCms), which this Pillow build lacks; convert the image to RGB before "
                          "packing it, or build Pillow-SIMD with littleCMS (liblcms2-dev)")
    return im


def _check_shape(width: int, height: int, cfg: JobConfig) -> None:
    """img2dataset's filters: a tiny thumbnail or a banner would be mostly invented or cut-off pixels."""
    short, long = min(width, height), max(width, height)
    if short < cfg.min_image_size:
        raise SampleError(FailureCode.TOO_SMALL, f"image too small ({width}x{height}: short side"
                                                 f" < min_image_size {cfg.min_image_size})")
    if cfg.max_aspect_ratio is not None and long / short > cfg.max_aspect_ratio:
        raise SampleError(FailureCode.ASPECT_RATIO,
                          f"aspect ratio too large ({width}x{height} is {long / short:.2f}:1"
                          f" > max_aspect_ratio {cfg.max_aspect_ratio:g})")


def _check_jpeg(layout: JpegLayout | None, cfg: JobConfig) -> None:
    if layout is None:
        return  # not a well-formed marker sequence: the decoder gives its own reason
    if layout.scans > cfg.max_jpeg_scans:
        raise SampleError(FailureCode.TOO_MANY_SCANS,
                          f"too many JPEG scans ({layout.scans} > max_jpeg_scans {cfg.max_jpeg_scans};"
                          " decode time grows with each)")
    if not layout.complete:
        if layout.stray_marker:  # the scans after it are never read: the same words as a cut inside a scan
            raise SampleError(FailureCode.SCAN_ENDS_EARLY, _SCAN_ENDS_EARLY)
        if layout.eoi is None:
            raise SampleError(FailureCode.TRUNCATED,
                              f"truncated JPEG (the data ends after {layout.scans} scan(s))")
        raise SampleError(FailureCode.INCOMPLETE_JPEG,
                          "incomplete JPEG (its scans stop before every component is complete:"
                          " cut between two scans)")


def _check_decoded_bytes(im: Image.Image, layout: JpegLayout | None, cfg: JobConfig) -> None:
    """Refuse before decoding what would take more than ``max_decoded_bytes`` (``im`` after any draft)."""
    keyed = "transparency" in im.info and im.mode in ("P", "L", "RGB", "1")
    _check_decoded_size(im.width, im.height, im.mode, keyed, _coefficient_bytes(layout), cfg)


def _coefficient_bytes(layout: JpegLayout | None) -> int:
    """The DCT coefficients libjpeg keeps for a JPEG of several scans (progressive, or one scan a component)
    while it reads them: every block of the whole image, 64 coefficients of 2 bytes, at full resolution
    whatever the draft scale (a 9400x9400 4:4:4 progressive JPEG: 3 x 1175^2 x 128 B = 506 MiB). A single
    interleaved scan is decoded one MCU row at a time: 0. Each component's blocks are padded to its
    sampling factors, as libjpeg allocates them (jdcoefct.c)."""
    if layout is None or not layout.sampling or (layout.scans <= 1 and not layout.progressive):
        return 0
    max_h = max(h for h, _ in layout.sampling)
    max_v = max(v for _, v in layout.sampling)
    blocks = 0
    for h, v in layout.sampling:
        columns = -(-(-(-layout.width * h // max_h)) // 8)  # ceil(ceil(width * h / max_h) / 8)
        rows = -(-(-(-layout.height * v // max_v)) // 8)
        blocks += -(-columns // h) * h * (-(-rows // v) * v)
    return blocks * 64 * 2


def _check_decoded_size(width: int, height: int, mode: str, keyed: bool, coefficients: int,
                        cfg: JobConfig) -> None:
    conversion = _KEYED_EXTRA_BYTES if keyed else _CONVERSION_BYTES.get(mode, 4)
    per_pixel = _DECODED_BYTES.get(mode, 4) + conversion
    # Pillow resizes in two passes: the first keeps one full source side at the target's other size.
    needed = width * height * per_pixel + 4 * cfg.max_side * max(width, height) + coefficients
    if needed > cfg.max_decoded_bytes:
        kept = (f", + {coefficients / 2**20:.0f} MiB of DCT coefficients a multi-scan JPEG keeps"
                if coefficients else "")
        raise SampleError(FailureCode.DECODED_BYTES,
                          f"decoded size too large (~{needed / 2**20:.0f} MiB for {width}x{height} {mode},"
                          f" {per_pixel} bytes a pixel with its conversion to RGB{kept}"
                          f" > max_decoded_bytes {cfg.max_decoded_bytes})")


def _sniff(data: bytes) -> tuple[FailureCode, str]:
    """What bytes no decoder took look like: a broken JPEG, text (an HTML error page saved as .jpg), other."""
    head = data[:16]
    if head.startswith(b"\xff\xd8"):
        return FailureCode.BAD_JPEG_HEADER, "JPEG signature but unreadable header"
    if head.startswith(_TIFF_MAGIC):
        return FailureCode.UNREADABLE_TIFF, f"a TIFF the decoder cannot read: {_tiff_problem(data)}"
    if all(32 <= b < 127 or b in (9, 10, 13) for b in head):
        return FailureCode.NOT_AN_IMAGE, "looks like text"
    return FailureCode.UNKNOWN_FORMAT, "unknown signature " + head[:4].hex()


def _tiff_problem(data: bytes) -> str:
    """Why Pillow's TIFF reader refused ``data`` (its own words), and the layout its first directory
    declares: what a user needs to convert the file (Pillow reads 1-4 samples of 8 or 16 bits with a known
    photometric interpretation, and only some extra-sample combinations)."""
    try:
        TiffImagePlugin.TiffImageFile(io.BytesIO(data))
        why = "refused by the decoder"
    except Exception as e:  # untrusted bytes: any failure of the TIFF reader is described, never raised
        why = " ".join(str(e).split()) or type(e).__name__
    try:
        ifd = TiffImagePlugin.ImageFileDirectory_v2(data[:8])
        stream = io.BytesIO(data)
        stream.seek(ifd.next)
        ifd.load(stream)
        photometric = ifd.get(262)
        layout = [f"{_PHOTOMETRIC.get(photometric, f'photometric {photometric}')}",
                  f"{ifd.get(277, 1)} sample(s) per pixel of {'/'.join(map(str, ifd.get(258, ()))) or '?'} bits"]
        extra = ifd.get(338)
        if extra:
            layout.append("extra samples: " + ", ".join(_EXTRA_SAMPLES.get(e, str(e)) for e in extra))
        return f"{why} ({'; '.join(layout)}); convert it to RGB or RGBA (8 bits) before packing it"
    except Exception:  # a directory that does not even parse: the decoder's words are all there is
        return f"{why}; convert it to RGB or RGBA (8 bits) before packing it"


def _decoder_failure_code(error: Exception) -> FailureCode:
    """``truncated`` when Pillow ran out of data, else ``decode_error``.

    Pillow says "out of data" only in words, two fixed messages (``ImageFile.load``: "image file is
    truncated (N bytes not processed)"; ``ImageFile._safe_read``: "Truncated File Read"). A cut download
    is the most common bad image on the web, and the marker checks above catch only the JPEGs whose
    markers are whole, so Pillow's own verdict is read here, once, where the exception is raised.
    """
    if isinstance(error, OSError) and str(error).startswith(_PILLOW_TRUNCATED):
        return FailureCode.TRUNCATED
    return FailureCode.DECODE_ERROR


def _orientation(im: Image.Image) -> int:
    return _read_orientation(im.getexif)


def _exif_orientation(exif: bytes | None) -> int:
    """``_orientation`` of a JPEG from its Exif segment alone (what Pillow's ``getexif`` loads)."""
    if exif is None:
        return 1

    def parse() -> Image.Exif:
        parsed = Image.Exif()
        parsed.load(exif)
        return parsed

    return _read_orientation(parse)


def _read_orientation(get_exif: Callable[[], Image.Exif]) -> int:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "Corrupt EXIF data": one log line per image is only noise
            value = get_exif().get(_EXIF_ORIENTATION, 1)
    except Exception:  # a corrupt EXIF block must not cost the image: treat it as upright
        return 1
    return value if isinstance(value, int) and 1 <= value <= 8 else 1


def _composite(rgb: Image.Image, alpha: Image.Image, background: tuple[int, int, int]) -> Image.Image:
    canvas = Image.new("RGB", rgb.size, background)
    canvas.paste(rgb, mask=alpha)
    return canvas


def _to_rgb(im: Image.Image, background: tuple[int, int, int]) -> Image.Image:
    mode = im.mode
    # A PNG colour key (tRNS on L/RGB/1) is transparency too: without this its pixels would keep the key
    # colour instead of showing the background.
    keyed = "transparency" in im.info and mode in ("P", "L", "RGB", "1")
    if (mode == "RGB" and not keyed) or mode == "RGBX":  # RGBX's fourth byte is dropped when packed
        return im
    if mode in ("P", "L", "RGB", "1"):
        if not keyed:
            return im.convert("RGB")
        im = im.convert("RGBA")
        mode = im.mode
    if mode in ("RGBA", "LA", "PA", "RGBa", "La"):
        rgba = im.convert("RGBA")
        return _composite(rgba, rgba.getchannel("A"), background)
    if mode.startswith("I"):
        # 16-bit samples (PNG/TIFF give I;16* or I): scale 0-65535 onto 0-255, never clip.
        values = np.clip(np.asarray(im).astype(np.int64), 0, 65535)
        gray = Image.fromarray(((values * 255 + 32767) // 65535).astype(np.uint8), "L").convert("RGB")
        key = im.info.get("transparency")
        if isinstance(key, int):
            alpha = Image.fromarray(np.where(values == key, 0, 255).astype(np.uint8))
            return _composite(gray, alpha, background)
        return gray
    if mode == "F":
        values = np.asarray(im, dtype=np.float32)
        if values.size and float(values.max()) <= 1.0:
            values = values * 255.0  # float images are usually in [0, 1]
        return Image.fromarray(np.clip(np.rint(values), 0, 255).astype(np.uint8), "L").convert("RGB")
    return im.convert("RGB")  # L, 1, CMYK (Adobe-inverted handled by the decoder), YCbCr, LAB, HSV


def _crop_top_left(kept: tuple[float, float, float, float], content: tuple[float, float],
                   stored: tuple[int, int], orientation: int) -> tuple[int, int]:
    """(top, left) of the kept region (``ResizeMode.kept_box``) in the upright source's pixels: the box is
    the one the resize read, in decoded pixels of a draft at 1/s (``stored / content`` is s exactly), scaled
    to the stored image and turned upright; halves round up. Its float error (~1e-13) is dropped first, so
    that a half-pixel offset (129x64 to 96x64: 16.5 columns) rounds alike at every draft scale and
    orientation. (0, 0) for a mode that keeps the whole picture (pad, stretch)."""
    scale_x, scale_y = stored[0] / content[0], stored[1] / content[1]
    x0, y0, x1, y1 = kept
    left, top, _, _ = _transposed_box((x0 * scale_x, y0 * scale_y, x1 * scale_x, y1 * scale_y), stored,
                                      orientation)
    return math.floor(round(top, 6) + 0.5), math.floor(round(left, 6) + 0.5)


def _transposed_box(box: tuple[Coordinate, Coordinate, Coordinate, Coordinate], canvas: tuple[int, int],
                    orientation: int) -> tuple[Coordinate, Coordinate, Coordinate, Coordinate]:
    """``box`` on a ``canvas`` (width, height) after ``_TRANSPOSE[orientation]``: the same rectangle of
    pixels, in the upright output's coordinates (end-exclusive edges map to end-exclusive edges; whole
    pixels, or a fractional region's edges alike)."""
    x0, y0, x1, y1 = box
    w, h = canvas
    if orientation == 2:  # FLIP_LEFT_RIGHT
        return w - x1, y0, w - x0, y1
    if orientation == 3:  # ROTATE_180
        return w - x1, h - y1, w - x0, h - y0
    if orientation == 4:  # FLIP_TOP_BOTTOM
        return x0, h - y1, x1, h - y0
    if orientation == 5:  # TRANSPOSE: (x, y) -> (y, x)
        return y0, x0, y1, x1
    if orientation == 6:  # ROTATE_270 (clockwise): (x, y) -> (h - 1 - y, x)
        return h - y1, x0, h - y0, x1
    if orientation == 7:  # TRANSVERSE: (x, y) -> (h - 1 - y, w - 1 - x)
        return h - y1, w - x1, h - y0, w - x0
    if orientation == 8:  # ROTATE_90 (counter-clockwise): (x, y) -> (y, w - 1 - x)
        return y0, w - x1, y1, w - x0
    return box


def process_image(data: bytes, cfg: JobConfig, timings: dict[str, float] | None = None) -> ProcessedImage:
    """Decode, orient, convert and resize one image to (cfg.height, cfg.width, 3) uint8; in ``mode: bucket``
    to its bucket's (height, width, 3) (``ProcessedImage.bucket`` says which), the bucket chosen by the
    upright size before decoding for a JPEG (so the draft and region decode serve that shape).

    ``timings``, when given, receives seconds per stage (open, decode, convert, resize) for ``diagnose``.
    Raises ``SampleError`` for anything wrong with the image itself.
    """
    clock = time.perf_counter
    t0 = clock()
    layout: JpegLayout | None = None
    bucket = 0
    resize = resize_mode(cfg.mode)  # the mode's row, asked from here on (``preprocess.image.resize_modes``)
    try:
        if data.startswith(b"\xff\xd8") and jpeg_region.available():
            layout = jpeg_layout(data)
        if jpeg_region.plain(layout):
            assert layout is not None
            im, (stored_w, stored_h), orientation, content, t1, cfg, bucket = _decode_plain_jpeg(
                data, layout, cfg, resize, clock)
            is_jpeg, source_format, source_mode = True, "JPEG", _JPEG_MODES[layout.components]
            decoded = True
        else:
            im = _open(data, cfg)
            stored_w, stored_h = im.size
            is_jpeg = im.format in _JPEG_FORMATS
            layout = (layout or jpeg_layout(data)) if is_jpeg else None
            _check_jpeg(layout, cfg)
            # A JPEG's EXIF came with its header, and draft needs the upright target before decoding; other
            # formats are asked after the one load (see the module docstring).
            orientation = _orientation(im) if is_jpeg else 1
            if is_jpeg:  # the bucket before the draft, from the header's size (others: after their one load)
                cfg, bucket = resize.image_config(cfg, *_upright(stored_w, stored_h, orientation))
            t1 = clock()
            content: tuple[float, float] = (stored_w, stored_h)
            if cfg.draft and is_jpeg:
                rotated = orientation >= 5  # 5-8 swap width and height
                drafted = im.draft("RGB", resize.draft_request(im.size, _target(cfg, rotated)))
                if drafted is not None:
                    content = drafted[1][2], drafted[1][3]
            source_format, source_mode = str(im.format or ""), im.mode
            _check_decoded_bytes(im, layout, cfg)
            decoded = False
            if is_jpeg and jpeg_region.applies(im, layout):  # e.g. a JPEG with XMP: Pillow read its header
                assert layout is not None
                target = _target(cfg, orientation >= 5)
                config = im.decoderconfig
                im = jpeg_region.decode(data, layout, int(config[0]) if config else 1, im.size,
                                        resize.kept_box(target, content), target, _RESAMPLE[cfg.resample])
                decoded = True
        if not decoded:
            if layout is not None:
                use_strict_decoder(im, layout, data)
            if is_jpeg:
                # The whole file in one read and one decoder call, not 64 KB at a time: Pillow's load loop
                # copies what is left of the buffer after each call (~1% of a draft decode).
                im.decodermaxblock = max(len(data), ImageFile.MAXBLOCK)
            im.load()
        if not is_jpeg:
            orientation = _orientation(im)
            cfg, bucket = resize.image_config(cfg, *_upright(stored_w, stored_h, orientation))
        rotated = orientation >= 5
        t2 = clock()
        im = _to_rgb(im, cfg.background)
        t3 = clock()
        target = _target(cfg, rotated)
        out = resize.place(im, target, content, _RESAMPLE[cfg.resample], cfg.fill)
        crop_top_left = _crop_top_left(resize.kept_box(target, content), content, (stored_w, stored_h),
                                       orientation)
        content_box = resize.content_box(target, content)  # pad's: where the picture lies on the fill
        if content_box is not None:
            content_box = _transposed_box(content_box, target, orientation)
        if orientation in _TRANSPOSE:
            out = out.transpose(_TRANSPOSE[orientation])
        # Packed once (Pillow keeps RGB as 4 bytes a pixel) into bytes that the array shares: no copy after,
        # and none of numpy's array-interface parsing (~0.8% of an image's time with np.asarray).
        # A region decode's RGBX drops its fourth byte here, in the same pass.
        pixels = np.frombuffer(out.tobytes("raw", "RGB"), np.uint8).reshape(out.height, out.width, 3)
        t4 = clock()
    except SampleError:
        raise
    except ScanDataEnded:
        if layout is not None and layout.eoi is None:
            raise SampleError(FailureCode.TRUNCATED, "truncated JPEG (the data ends inside a scan)") from None
        raise SampleError(FailureCode.SCAN_ENDS_EARLY, _SCAN_ENDS_EARLY) from None
    except Exception as e:  # untrusted bytes: any decoder failure is this sample's, never the job's
        raise SampleError(_decoder_failure_code(e), f"cannot decode: {type(e).__name__}: {e}") from e
    if pixels.shape != (cfg.height, cfg.width, 3):
        raise SampleError(FailureCode.INTERNAL,
                          f"internal: produced {pixels.shape}, expected {(cfg.height, cfg.width, 3)}")
    if t4 - t0 > cfg.max_decode_seconds:
        raise SampleError(FailureCode.DECODE_TIMEOUT, f"decode too slow ({t4 - t0:.1f} s"
                                                      f" > max_decode_seconds {cfg.max_decode_seconds:g})")
    if timings is not None:
        timings["open"] = t1 - t0
        timings["decode"] = t2 - t1
        timings["convert"] = t3 - t2
        timings["resize"] = t4 - t3
    width, height = _upright(stored_w, stored_h, orientation)
    return ProcessedImage(
        pixels=pixels,
        width=width,
        height=height,
        format=source_format,
        mode=source_mode,
        draft_scale=max(1, round(stored_w / content[0])),
        upscaled=resize.upscales((width, height), (cfg.width, cfg.height)),
        content_box=content_box,
        bucket=bucket,
        crop_top_left=crop_top_left,
    )


def _decode_plain_jpeg(
    data: bytes, layout: JpegLayout, cfg: JobConfig, resize: ResizeMode, clock: Callable[[], float]
) -> tuple[Image.Image, tuple[int, int], int, tuple[float, float], float, JobConfig, int]:
    """A JPEG with a plain header (``jpeg_region.plain``) from its marker layout, without Pillow's header
    parse (~2% of an image's time): the same limits, orientation, draft scale and pixels as the path that
    opens it with Pillow (``tests/preprocess/image/test_jpeg_region.py`` compares them). Returns the RGBX region image,
    the stored size, the orientation, the decoded picture's extent, the clock after the header checks, and the
    image's config and bucket (``ResizeMode.image_config``)."""
    width, height = layout.width, layout.height
    if width * height > cfg.max_image_pixels:  # Pillow's bomb check, in its words (see ``_open``)
        raise SampleError(FailureCode.TOO_MANY_PIXELS,
                          f"pixel bomb: {width * height} pixels > max_image_pixels {cfg.max_image_pixels}")
    _check_shape(width, height, cfg)
    _check_jpeg(layout, cfg)
    orientation = _exif_orientation(layout.exif)
    cfg, bucket = resize.image_config(cfg, *_upright(width, height, orientation))
    t1 = clock()
    target = _target(cfg, orientation >= 5)
    scale = jpeg_region.draft_scale((width, height), resize.draft_request((width, height), target)) \
        if cfg.draft else 1
    size = (-(-width // scale), -(-height // scale))
    content = (width / scale, height / scale)  # Pillow's draft box
    mode = _JPEG_MODES[layout.components]
    _check_decoded_size(size[0], size[1], mode, False, _coefficient_bytes(layout), cfg)
    im = jpeg_region.decode(data, layout, scale, size, resize.kept_box(target, content), target,
                            _RESAMPLE[cfg.resample])
    return im, (width, height), orientation, content, t1, cfg, bucket


def _target(cfg: JobConfig, rotated: bool) -> tuple[int, int]:
    """The resize target in stored orientation: the output is transposed upright afterwards."""
    return (cfg.height, cfg.width) if rotated else (cfg.width, cfg.height)


def _upright(stored_w: int, stored_h: int, orientation: int) -> tuple[int, int]:
    """(width, height) of the image as displayed: EXIF orientations 5-8 swap the stored sides."""
    return (stored_h, stored_w) if orientation >= 5 else (stored_w, stored_h)
