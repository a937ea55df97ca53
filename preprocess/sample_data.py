"""A small deterministic WebDataset sample dataset, as img2dataset writes for LAION.

``python -m preprocess.sample_data DIR`` writes ``DIR/{00000..0000N}.tar`` of photo-like JPEGs at web sizes
(1-2.5 megapixels, quality 80-95, ~1.5 bits per pixel: multi-scale texture, not flat colour, so decode
cost is realistic), each with ``.json``, ``.txt`` and ``.cls``. The same arguments give the same bytes.
A few samples are the awkward cases real crawls hold: EXIF-rotated, grayscale, CMYK, PNG with alpha, and
one truncated JPEG (counted as a failed sample, not fatal).
"""

from __future__ import annotations

import io
import json
import os
import sys
import tarfile
from collections.abc import Iterable

import numpy as np
from PIL import Image

__all__ = ["photo_like", "encode_jpeg", "write_tar", "make_sample_dataset"]

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


def _awkward(rng: np.random.Generator, kind: str) -> tuple[str, bytes]:
    image = photo_like(rng, 1200, 900)
    out = io.BytesIO()
    if kind == "rotated":
        return "jpg", encode_jpeg(image, 90, orientation=6)
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
    awkward = {5: "rotated", 11: "gray", 17: "cmyk", 23: "png_alpha", 29: "truncated"}
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
            if t == 0 and i in awkward:
                ext, data = _awkward(rng, awkward[i])
                width, height = 1200, 900
            else:
                width, height = _WEB_SIZES[int(rng.integers(len(_WEB_SIZES)))]
                ext, data = "jpg", encode_jpeg(photo_like(rng, width, height), int(rng.integers(80, 96)))
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


if __name__ == "__main__":
    target = sys.argv[1] if len(sys.argv) > 1 else "data/sample"
    written = make_sample_dataset(target)
    print(f"sample dataset: {len(written)} tars in {target}")
