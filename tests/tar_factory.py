"""Generated WebDataset tars for tests: self-identifying images and any malformation a test needs.

Each good image encodes its sample index in its flat colour, 4 bits per channel in steps of 16 (up to
4,096 indices), so JPEG's few levels of colour error round off and, after any resize, the centre pixel
still says which sample it is: one assertion catches a lost, duplicated or reordered sample.
"""

from __future__ import annotations

import io
import json
import math
import os
import tarfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from fractions import Fraction

import numpy as np
from PIL import Image

__all__ = [
    "TarFactory", "Member", "index_image", "decode_index", "jpeg_bytes", "png_bytes", "read_shards",
    "centre_crop_top_left",
]


def index_image(index: int, width: int = 320, height: int = 240, mode: str = "RGB") -> Image.Image:
    colour = tuple(((index >> shift) % 16) * 16 + 8 for shift in (0, 4, 8))
    image = Image.new("RGB", (width, height), colour)
    return image if mode == "RGB" else image.convert(mode)


def decode_index(pixels: np.ndarray) -> int:
    """Inverse of ``index_image`` on processed pixels (centre pixel; JPEG error of a few levels rounds off)."""
    h, w = pixels.shape[:2]
    nibbles = [min(15, max(0, round((int(v) - 8) / 16))) for v in pixels[h // 2, w // 2, :3]]
    return nibbles[0] + (nibbles[1] << 4) + (nibbles[2] << 8)


def jpeg_bytes(image: Image.Image, quality: int = 95, **save_args) -> bytes:
    out = io.BytesIO()
    save_args.setdefault("subsampling", 0)  # 4:4:4, so flat colours survive exactly enough
    image.save(out, "JPEG", quality=quality, **save_args)
    return out.getvalue()


def png_bytes(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, "PNG")
    return out.getvalue()


def centre_crop_top_left(upright: tuple[int, int], target: tuple[int, int]) -> tuple[int, int]:
    """(top, left) of a centre crop of the ``upright`` (width, height) source to the ``target`` (width,
    height) aspect ratio, in source pixels, computed exactly (fractions) and rounded half up: what a
    transform's ``crop_top_left`` must be, whatever its draft scale, decode path or EXIF orientation."""
    (width, height), (target_w, target_h) = upright, target
    scale = max(Fraction(target_w, width), Fraction(target_h, height))
    top, left = (height - target_h / scale) / 2, (width - target_w / scale) / 2
    return math.floor(top + Fraction(1, 2)), math.floor(left + Fraction(1, 2))


@dataclass
class Member:
    name: str
    data: bytes = b""
    kind: str = "file"  # file | dir | symlink | hardlink
    target: str = ""


@dataclass
class TarFactory:
    directory: str
    made: list[str] = field(default_factory=list)

    def path(self, name: str) -> str:
        os.makedirs(self.directory, exist_ok=True)
        return os.path.join(self.directory, name)

    def derive(self, name: str, source: str, transform: Callable[[bytes], bytes]) -> str:
        """A new file ``name`` holding ``transform(bytes of source)``: a tar cut short, compressed, or both."""
        with open(source, "rb") as f:
            data = transform(f.read())
        path = self.path(name)
        with open(path, "wb") as f:
            f.write(data)
        return path

    def write(self, name: str, members: Iterable[Member]) -> str:
        path = self.path(name)
        with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tar:
            for m in members:
                info = tarfile.TarInfo(m.name)
                info.mtime = 1_700_000_000
                if m.kind == "dir":
                    info.type = tarfile.DIRTYPE
                    tar.addfile(info)
                elif m.kind in ("symlink", "hardlink"):
                    info.type = tarfile.SYMTYPE if m.kind == "symlink" else tarfile.LNKTYPE
                    info.linkname = m.target
                    tar.addfile(info)
                else:
                    info.size = len(m.data)
                    tar.addfile(info, io.BytesIO(m.data))
        self.made.append(path)
        return path

    def samples(self, indices: Iterable[int], *, prefix: str = "", size: tuple[int, int] = (320, 240),
                with_meta: bool = True) -> list[Member]:
        """Members of good samples: ``{prefix}{index:06d}.jpg/.txt/.cls/.json``."""
        members = []
        for index in indices:
            key = f"{prefix}{index:06d}"
            members.append(Member(f"{key}.jpg", jpeg_bytes(index_image(index, *size))))
            if with_meta:
                members += [
                    Member(f"{key}.txt", f"caption {index}".encode()),
                    Member(f"{key}.cls", str(index).encode()),
                    Member(f"{key}.json", json.dumps({"index": index}).encode()),
                ]
        return members

    def make(self, name: str, indices: Iterable[int], **kwargs) -> str:
        return self.write(name, self.samples(indices, **kwargs))


def read_shards(output_dir: str, shards: Iterable[dict]) -> tuple[np.ndarray, list[dict]]:
    """Pixels (N, H, W, 3) and metadata rows of ``InputResult.shards``, read with numpy and json alone."""
    pixels, rows = [], []
    for entry in shards:
        pixels.append(np.load(os.path.join(output_dir, entry["path"])))
        with open(os.path.join(output_dir, entry["meta_path"]), encoding="utf-8") as f:
            rows += [json.loads(line) for line in f.read().split("\n") if line]
    return (np.concatenate(pixels) if pixels else np.zeros((0, 0, 0, 3), np.uint8)), rows
