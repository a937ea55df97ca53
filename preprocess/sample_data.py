"""A small deterministic WebDataset sample dataset, as img2dataset writes for LAION.

``python -m preprocess.sample_data DIR`` writes ``DIR/{00000..0000N}.tar`` of photo-like JPEGs at web sizes
(1-2.5 megapixels, quality 80-95, ~1.5 bits per pixel: multi-scale texture, not flat colour, so decode
cost is realistic), each with ``.json``, ``.txt`` and ``.cls``. The same arguments give the same bytes.

Each image says at a glance whether the job cropped and oriented it right (``shardio preview``): an "UP"
arrow, a border coloured by side (top red, right yellow, bottom blue, left green), corner labels, a ring
centred on the image (a centre crop keeps it whole and centred) and the sample index as text. A few
samples are the awkward cases real crawls hold: EXIF orientations 2, 3, 6 and 8 (the pixels are stored
turned or mirrored, so a missing or wrong transpose shows a tilted arrow or mirrored text), grayscale,
CMYK, PNG with alpha, and one truncated JPEG (counted as a failed sample, not fatal). The folder also gets
``.sample-dataset.json`` (hidden: a glob skips it) naming the samples that fail on purpose, so that
``preprocess run`` can say, under its summary, that a newcomer's first run ending "failed 1" is meant
(``on_purpose_notes``).

No real photos: the registry packages that ship some (scikit-image's ``data``, imageio's standard
images) require stock ``pillow``, which would replace Pillow-SIMD, and scipy's datasets download at use.
"""

from __future__ import annotations

import io
import json
import os
import sys
import tarfile
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
from PIL import Image, ImageDraw, ImageFont

__all__ = ["photo_like", "annotate", "stored_for_orientation", "encode_jpeg", "write_tar",
           "make_sample_dataset", "SIDE_COLOURS", "MARKER_NAME", "on_purpose_notes"]

# Border colour of each side of the upright image: in a preview, red must be at the top.
SIDE_COLOURS = {"top": (220, 30, 30), "right": (240, 200, 20), "bottom": (30, 60, 220), "left": (30, 170, 60)}

# The transpose that turns the upright image into the stored pixels for an EXIF orientation: the inverse
# of what a viewer applies (6 is displayed rotated 270 degrees counter-clockwise, so it is stored
# rotated 90; the others are their own inverse).
_STORE = {
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_90,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_270,
}

# The file beside the tars that names the samples failing on purpose: {"on_purpose": {tar: {key: why}}}.
MARKER_NAME = ".sample-dataset.json"
# Why each awkward case that cannot be decoded is there (the others decode).
_ON_PURPOSE = {"truncated": "a JPEG cut in half on purpose, to show that a bad image is counted and skipped, "
                            "not fatal"}

_WEB_SIZES = [(1600, 1067), (1280, 960), (1024, 1024), (1920, 1080), (1200, 1600), (1440, 1080), (1280, 853)]


def photo_like(rng: np.random.Generator, width: int, height: int) -> Image.Image:
    """RGB image with soft shapes, texture and fine grain, so JPEG spends ~1.5 bits/pixel like a photo.

    Mostly luminance detail with weaker colour variation, as in natural images.
    """
    luma = np.zeros((height, width), np.float32)
    for cells, amplitude in ((4, 60.0), (24, 30.0), (160, 16.0)):
        small = rng.standard_normal((max(2, cells * height // width), cells), dtype=np.float32) * amplitude
        up = Image.fromarray(small, "F").resize((width, height), Image.Resampling.BICUBIC)
        luma += np.asarray(up, np.float32)
    luma += rng.standard_normal((height, width), dtype=np.float32) * 4.0  # sensor grain
    chroma_cells = rng.standard_normal((3, 6, 3), dtype=np.float32) * 40.0
    chroma = np.stack(
        [np.asarray(Image.fromarray(chroma_cells[..., c], "F").resize((width, height), Image.Resampling.BICUBIC))
         for c in range(3)], axis=-1)
    base = rng.uniform(70, 180, 3).astype(np.float32)
    return Image.fromarray(np.clip(luma[..., None] + chroma + base, 0, 255).astype(np.uint8))


def _font(size: int) -> ImageFont.ImageFont | ImageFont.FreeTypeFont:
    try:
        return ImageFont.load_default(size=size)  # Pillow >= 10.1 with FreeType: a scalable font
    except (TypeError, ImportError, OSError):
        return ImageFont.load_default()


def _text(draw: ImageDraw.ImageDraw, xy: tuple[float, float], text: str, size: int, anchor: str) -> None:
    draw.text(xy, text, fill=(255, 255, 255), font=_font(size), anchor=anchor, stroke_width=max(1, size // 12),
              stroke_fill=(0, 0, 0))


def annotate(image: Image.Image, index: int, note: str = "") -> Image.Image:
    """``image`` (upright) with the orientation and crop markers and the sample index drawn on it."""
    image = image.convert("RGB")
    width, height = image.size
    side = min(width, height)
    draw = ImageDraw.Draw(image)
    bar = max(8, side // 28)
    draw.rectangle((0, 0, width, bar), fill=SIDE_COLOURS["top"])
    draw.rectangle((0, height - bar, width, height), fill=SIDE_COLOURS["bottom"])
    draw.rectangle((0, bar, bar, height - bar), fill=SIDE_COLOURS["left"])
    draw.rectangle((width - bar, bar, width, height - bar), fill=SIDE_COLOURS["right"])
    corner = side // 16
    for label, xy, anchor in (("TL", (2 * bar, 2 * bar), "lt"), ("TR", (width - 2 * bar, 2 * bar), "rt"),
                              ("BL", (2 * bar, height - 2 * bar), "lb"),
                              ("BR", (width - 2 * bar, height - 2 * bar), "rb")):
        _text(draw, xy, label, corner, anchor)
    cx, cy = width / 2, height / 2
    ring = 0.44 * side  # inside the centre square a centre crop keeps, with the bars beyond it
    draw.ellipse((cx - ring, cy - ring, cx + ring, cy + ring), outline=(255, 255, 255), width=max(4, side // 90))
    # The arrow: a shaft and a head, pointing to the top side, with "UP" under the head.
    shaft, head = 0.06 * side, 0.17 * side
    top, bottom = cy - 0.36 * side, cy + 0.02 * side
    draw.polygon([(cx, top), (cx + head, top + head * 1.1), (cx + shaft, top + head * 1.1),
                  (cx + shaft, bottom), (cx - shaft, bottom), (cx - shaft, top + head * 1.1),
                  (cx - head, top + head * 1.1)], fill=(255, 255, 255), outline=(0, 0, 0), width=max(2, side // 200))
    _text(draw, (cx, top + head * 1.25), "UP", int(0.07 * side), "mt")
    _text(draw, (cx, cy + 0.06 * side), f"#{index}", int(0.16 * side), "mt")
    if note:
        _text(draw, (cx, cy + 0.23 * side), note, int(0.1 * side), "mt")
    return image


def stored_for_orientation(upright: Image.Image, orientation: int) -> Image.Image:
    """The pixels to store with EXIF ``orientation`` so that a viewer applying the tag shows ``upright``."""
    return upright.transpose(_STORE[orientation]) if orientation in _STORE else upright


def encode_jpeg(image: Image.Image, quality: int, orientation: int = 1) -> bytes:
    out = io.BytesIO()
    exif = Image.Exif()
    if orientation != 1:
        exif[0x0112] = orientation
    image.save(out, "JPEG", quality=quality, exif=exif.tobytes() if orientation != 1 else b"")
    return out.getvalue()


def write_tar(path: str, members: Iterable[tuple[str, bytes]]) -> None:
    """Write a tar deterministically (fixed mtime/owner), atomically (temp + rename)."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with tarfile.open(tmp, "w", format=tarfile.USTAR_FORMAT) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode = len(data), 1_700_000_000, 0o644
            tar.addfile(info, io.BytesIO(data))
    os.replace(tmp, path)


def _awkward(rng: np.random.Generator, kind: str, index: int) -> tuple[str, bytes]:
    note = {"gray": "grayscale", "cmyk": "CMYK", "png_alpha": "PNG alpha"}.get(kind, "")
    if kind.startswith("exif"):
        note = f"EXIF {kind[4:]}"
    image = annotate(photo_like(rng, 1200, 900), index, note)
    out = io.BytesIO()
    if kind.startswith("exif"):
        orientation = int(kind[4:])
        return "jpg", encode_jpeg(stored_for_orientation(image, orientation), 90, orientation=orientation)
    if kind == "gray":
        image.convert("L").save(out, "JPEG", quality=85)
    elif kind == "cmyk":
        image.convert("CMYK").save(out, "JPEG", quality=85)
    elif kind == "png_alpha":
        rgba = image.resize((600, 450)).convert("RGBA")
        rgba.putalpha(128)
        rgba.save(out, "PNG")
        return "png", out.getvalue()
    elif kind == "truncated":
        data = encode_jpeg(image, 85)
        return "jpg", data[: len(data) // 2]
    return "jpg", out.getvalue()


def make_sample_dataset(directory: str, tars: int = 4, samples_per_tar: int = 48, seed: int = 0) -> list[str]:
    """Write the sample tars into ``directory`` (skipping ones already there); return their paths."""
    os.makedirs(directory, exist_ok=True)
    paths = []
    # (tar, sample in tar) -> the awkward case it is
    awkward = {(0, 5): "exif6", (0, 11): "gray", (0, 17): "cmyk", (0, 23): "png_alpha", (0, 29): "truncated",
               (1, 5): "exif3", (1, 11): "exif8", (2, 5): "exif2", (3, 5): "exif6"}
    on_purpose: dict[str, dict[str, str]] = {}
    for (t, i), kind in awkward.items():
        if t < tars and i < samples_per_tar and kind in _ON_PURPOSE:
            on_purpose.setdefault(f"{t:05d}.tar", {})[f"{t:05d}{i:04d}"] = _ON_PURPOSE[kind]
    with open(os.path.join(directory, MARKER_NAME), "w", encoding="utf-8") as marker:
        json.dump({"about": "the sample dataset of preprocess.sample_data", "on_purpose": on_purpose}, marker,
                  indent=1)
    for t in range(tars):
        path = os.path.join(directory, f"{t:05d}.tar")
        paths.append(path)
        if os.path.exists(path):
            continue
        rng = np.random.default_rng([seed, t])
        members = []
        for i in range(samples_per_tar):
            index = t * samples_per_tar + i
            key = f"{t:05d}{i:04d}"
            if (t, i) in awkward:
                ext, data = _awkward(rng, awkward[t, i], index)
                width, height = 1200, 900
            else:
                width, height = _WEB_SIZES[int(rng.integers(len(_WEB_SIZES)))]
                image = annotate(photo_like(rng, width, height), index)
                ext, data = "jpg", encode_jpeg(image, int(rng.integers(80, 96)))
            caption = f"sample {index}: a photo-like test image of {width}x{height} pixels"
            meta = {"key": key, "url": f"https://example.com/{key}.jpg", "width": width, "height": height,
                    "caption": caption, "status": "success"}
            members += [
                (f"{key}.{ext}", data),
                (f"{key}.txt", caption.encode()),
                (f"{key}.cls", str(index % 10).encode()),
                (f"{key}.json", json.dumps(meta).encode()),
            ]
        write_tar(path, members)
    return paths


def on_purpose_notes(failures: Iterable[Mapping[str, Any]]) -> list[str]:
    """One line per failed sample (a run report's ``{input, key, ...}``) that the sample dataset holds on
    purpose, read from the ``MARKER_NAME`` file beside its tar; [] for any other input (a URL is never
    read: only a local folder can be the generated sample)."""
    markers: dict[str, dict[str, dict[str, str]]] = {}
    notes = []
    for failure in failures:
        tar = str(failure.get("input", ""))
        if "://" in tar:
            continue
        folder = os.path.dirname(tar)
        if folder not in markers:
            try:
                with open(os.path.join(folder, MARKER_NAME), encoding="utf-8") as marker:
                    markers[folder] = dict(json.load(marker).get("on_purpose", {}))
            except (OSError, ValueError, AttributeError):
                markers[folder] = {}
        why = markers[folder].get(os.path.basename(tar), {}).get(str(failure.get("key")))
        if why:
            notes.append(f"{os.path.basename(tar)} sample {failure.get('key')} fails on purpose: {why}")
    return notes


if __name__ == "__main__":
    target = sys.argv[1] if len(sys.argv) > 1 else "data/sample"
    written = make_sample_dataset(target)
    print(f"sample dataset: {len(written)} tars in {target}")
