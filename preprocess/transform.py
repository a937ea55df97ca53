"""One encoded image (bytes) -> one H×W×3 uint8 array, as fast as the JPEG decoder allows.

The order of work is chosen for speed (figures in shared/PERF_NOTES.md, one core, 1.7 MP JPEG -> 256²):
full decode 5.7 ms, but ``draft`` (libjpeg-turbo DCT scaling) decodes at 1/2, 1/4 or 1/8 size for
~3.5 ms, and resizing only the kept region with ``resize(box=...)`` skips a separate crop. EXIF
orientation is folded in: the draft/resize target is swapped for orientations 5-8 and the small output is
transposed, never the large input.

Every failure of an untrusted image becomes a ``SampleError`` with a short reason; the job counts it and
goes on. ``LOAD_TRUNCATED_IMAGES`` is never set: a truncated JPEG is an error, not a grey bottom half.
"""

from __future__ import annotations

import io
import math
import time
import warnings
from dataclasses import dataclass

import numpy as np
from PIL import Image, UnidentifiedImageError

from preprocess.config import JobConfig
from shardio.errors import SampleError

__all__ = ["ProcessedImage", "process_image", "ALLOWED_FORMATS"]

# Routed by detected content, never by file extension. Cameras' multi-picture JPEGs (MPO) open as JPEG.
ALLOWED_FORMATS = ("JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF")
_JPEG_FORMATS = ("JPEG", "MPO")
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


def _open(data: bytes, cfg: JobConfig) -> Image.Image:
    if not data:
        raise SampleError("empty image member (0 bytes)")
    with warnings.catch_warnings():
        # Pillow only warns between MAX_IMAGE_PIXELS and twice that; here the warning band is an error.
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        try:
            im = Image.open(io.BytesIO(data), formats=ALLOWED_FORMATS)
        except UnidentifiedImageError:
            raise SampleError(f"not a supported image ({_sniff(data)}, {len(data)} bytes)") from None
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
            raise SampleError(f"pixel bomb: {e}") from None
    width, height = im.size
    if width < 1 or height < 1:
        raise SampleError(f"{im.format} with an empty size {width}x{height}")
    if width * height > cfg.max_image_pixels:
        raise SampleError(
            f"pixel bomb: {width}x{height} = {width * height} pixels > max_image_pixels {cfg.max_image_pixels}"
        )
    return im


def _sniff(data: bytes) -> str:
    head = data[:16]
    if head.startswith(b"\xff\xd8"):
        return "JPEG signature but unreadable header"
    if all(32 <= b < 127 or b in (9, 10, 13) for b in head):
        return "looks like text"
    return "unknown signature " + head[:4].hex()


def _orientation(im: Image.Image) -> int:
    try:
        value = im.getexif().get(_EXIF_ORIENTATION, 1)
    except Exception:  # a corrupt EXIF block must not cost the image: treat it as upright
        return 1
    return value if isinstance(value, int) and 1 <= value <= 8 else 1


def _draft_request(mode: str, size: tuple[int, int], target: tuple[int, int]) -> tuple[int, int]:
    """The smallest decoded size whose kept region still covers the target in both dimensions."""
    width, height = size
    target_w, target_h = target
    if mode == "stretch":
        return target_w, target_h
    fit = max if mode == "center_crop" else min
    scale = fit(target_w / width, target_h / height)
    return max(1, math.ceil(width * scale)), max(1, math.ceil(height * scale))


def _to_rgb(im: Image.Image, background: tuple[int, int, int]) -> Image.Image:
    mode = im.mode
    if mode == "RGB":
        return im
    if mode == "P":
        im = im.convert("RGBA" if "transparency" in im.info else "RGB")
        mode = im.mode
        if mode == "RGB":
            return im
    if mode in ("RGBA", "LA", "PA", "RGBa", "La"):
        rgba = im.convert("RGBA")
        canvas = Image.new("RGB", rgba.size, background)
        canvas.paste(rgba, mask=rgba.getchannel("A"))
        return canvas
    if mode.startswith("I"):
        # 16-bit samples (PNG/TIFF give I;16* or I): scale 0-65535 onto 0-255, never clip.
        values = np.asarray(im).astype(np.uint32)
        values = np.clip(values, 0, 65535)
        gray = ((values * 255 + 32767) // 65535).astype(np.uint8)
        return Image.fromarray(gray, "L").convert("RGB")
    if mode == "F":
        values = np.asarray(im, dtype=np.float32)
        if values.size and float(values.max()) <= 1.0:
            values = values * 255.0  # float images are usually in [0, 1]
        return Image.fromarray(np.clip(np.rint(values), 0, 255).astype(np.uint8), "L").convert("RGB")
    return im.convert("RGB")  # L, 1, CMYK (Adobe-inverted handled by the decoder), YCbCr, LAB, HSV


def _resize(im: Image.Image, cfg: JobConfig, target: tuple[int, int]) -> Image.Image:
    resample = _RESAMPLE[cfg.resample]
    target_w, target_h = target
    width, height = im.size
    if cfg.mode == "stretch":
        return im if im.size == target else im.resize(target, resample)
    if cfg.mode == "center_crop":
        scale = max(target_w / width, target_h / height)
        crop_w, crop_h = target_w / scale, target_h / scale
        left, top = (width - crop_w) / 2, (height - crop_h) / 2
        return im.resize(target, resample, box=(left, top, left + crop_w, top + crop_h))
    scale = min(target_w / width, target_h / height)
    inner = (max(1, min(target_w, round(width * scale))), max(1, min(target_h, round(height * scale))))
    canvas = Image.new("RGB", target, cfg.fill)
    canvas.paste(im.resize(inner, resample), ((target_w - inner[0]) // 2, (target_h - inner[1]) // 2))
    return canvas


def process_image(data: bytes, cfg: JobConfig, timings: dict[str, float] | None = None) -> ProcessedImage:
    """Decode, orient, convert and resize one image to (cfg.height, cfg.width, 3) uint8.

    ``timings``, when given, receives seconds per stage (open, decode, convert, resize) for ``diagnose``.
    Raises ``SampleError`` for anything wrong with the image itself.
    """
    clock = time.perf_counter
    t0 = clock()
    try:
        im = _open(data, cfg)
        orientation = _orientation(im)
        stored_w, stored_h = im.size
        rotated = orientation >= 5  # 5-8 swap width and height
        target = (cfg.height, cfg.width) if rotated else (cfg.width, cfg.height)
        t1 = clock()
        if cfg.draft and im.format in _JPEG_FORMATS:
            im.draft("RGB", _draft_request(cfg.mode, im.size, target))
        source_format, source_mode = str(im.format or ""), im.mode
        im.load()
        decoded_w = im.size[0]
        t2 = clock()
        im = _to_rgb(im, cfg.background)
        t3 = clock()
        out = _resize(im, cfg, target)
        if orientation in _TRANSPOSE:
            out = out.transpose(_TRANSPOSE[orientation])
        pixels = np.asarray(out)
        t4 = clock()
    except SampleError:
        raise
    except Exception as e:  # untrusted bytes: any decoder failure is this sample's, never the job's
        raise SampleError(f"cannot decode: {type(e).__name__}: {e}") from e
    if pixels.shape != (cfg.height, cfg.width, 3):
        raise SampleError(f"internal: produced {pixels.shape}, expected {(cfg.height, cfg.width, 3)}")
    if timings is not None:
        timings["open"] = t1 - t0
        timings["decode"] = t2 - t1
        timings["convert"] = t3 - t2
        timings["resize"] = t4 - t3
    return ProcessedImage(
        pixels=pixels,
        width=stored_h if rotated else stored_w,
        height=stored_w if rotated else stored_h,
        format=source_format,
        mode=source_mode,
        draft_scale=max(1, round(stored_w / decoded_w)),
    )
