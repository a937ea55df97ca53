"""The GPU check's datasets: the same photo-like images as a raw, a JPEG and a yuv420 dataset, written with
shardio's writer (no Ray, no Pillow-SIMD: the GPU machine's stock Pillow encodes, as the job's encoder would),
and a small JPEG dataset of larger images for the decoder's ceiling at a second size (``build_jpeg``).

``distinct`` images (``preprocess.sample_data.photo_like``: soft shapes, texture and grain, ~1.5 bits/pixel
like a photo) are encoded once at the compact config (``configs/jpeg.yaml``: quality 90, 4:4:4) and repeated
up to ``samples``: a decode's cost depends on the bytes, not on whether it saw them before. The raw dataset
holds the JPEGs' CPU decodes, so all three datasets carry the same pixels; the yuv420 one stores them as its
planes (``shardio.format.yuv_shard.rgb_to_yuv420``, the writer's conversion), so its read-back against the raw
dataset is the encoding's own loss.
"""

from __future__ import annotations

import io
import os
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import numpy as np

from shardio import ShardDataset
from shardio.format import InputEntry, Manifest
from shardio.read.jpeg_pixels import EncodedImages
from shardio.write.shard_writer import InputShardWriter, write_manifest

QUALITY, SUBSAMPLING = 90, "4:4:4"


@dataclass(frozen=True)
class GpuDatasets:
    raw: str
    jpeg: str
    yuv420: str
    samples: int
    side: int
    jpeg_bytes_mean: float


def _encoded(args: tuple[int, int]) -> bytes:
    from preprocess.sample_data import photo_like  # Pillow: the GPU machine's stock one serves here

    index, side = args
    image = photo_like(np.random.default_rng(1000 + index), side, side)
    out = io.BytesIO()
    image.save(out, "JPEG", quality=QUALITY, subsampling=0 if SUBSAMPLING == "4:4:4" else 2)
    return out.getvalue()


def _pixels(jpeg: bytes) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(jpeg)).convert("RGB"))


def _write(directory: str, side: int, samples: int, samples_per_shard: int, items: list, encoding: str) -> None:
    config: dict = {"height": side, "width": side}
    if encoding == "jpeg":
        config.update(encoding="jpeg", quality=QUALITY, subsampling=SUBSAMPLING)
    elif encoding == "yuv420":
        config.update(encoding="yuv420")
    manifest = Manifest(shape=(side, side, 3), config=config, versions={"shardio": "gpu-check"})
    writer = InputShardWriter(directory, "gpu", side, side, samples_per_shard, encoding)
    for index in range(samples):
        writer.add(items[index % len(items)], {"key": f"{index:08d}", "cls": index % 1000}, "gpu.tar")
    manifest.shards = writer.close("gpu.tar")
    manifest.inputs["gpu.tar"] = InputEntry(0, 0, samples, 0, [e.path for e in manifest.shards])
    write_manifest(directory, manifest)


def build(root: str, samples: int, distinct: int, side: int = 256, samples_per_shard: int = 1024,
          workers: int | None = None) -> GpuDatasets:
    """``root/raw``, ``root/jpeg`` and ``root/yuv420`` (each made once: an existing one is reused)."""
    raw, jpeg, yuv420 = (os.path.join(root, name) for name in ("raw", "jpeg", "yuv420"))
    workers = workers or min(16, os.cpu_count() or 1)
    with ProcessPoolExecutor(workers) as pool:
        jpegs = list(pool.map(_encoded, [(i, side) for i in range(distinct)], chunksize=16))
        if not _made(jpeg):
            _write(jpeg, side, samples, samples_per_shard, jpegs, "jpeg")
        if not (_made(raw) and _made(yuv420)):
            pixels = list(pool.map(_pixels, jpegs, chunksize=16))
            for directory, encoding in ((raw, "raw"), (yuv420, "yuv420")):
                if not _made(directory):
                    _write(directory, side, samples, samples_per_shard, pixels, encoding)
    return GpuDatasets(raw, jpeg, yuv420, samples, side, float(np.mean([len(j) for j in jpegs])))


def build_jpeg(directory: str, samples: int, distinct: int, side: int, samples_per_shard: int = 1024,
               workers: int | None = None) -> float:
    """A JPEG dataset alone at ``directory`` (made once), as ``build``'s; returns its JPEGs' mean bytes."""
    workers = workers or min(16, os.cpu_count() or 1)
    with ProcessPoolExecutor(workers) as pool:
        jpegs = list(pool.map(_encoded, [(i, side) for i in range(distinct)], chunksize=16))
    if not _made(directory):
        _write(directory, side, samples, samples_per_shard, jpegs, "jpeg")
    return float(np.mean([len(j) for j in jpegs]))


def _made(directory: str) -> bool:
    return os.path.exists(os.path.join(directory, "manifest.json"))


def encoded_batches(jpeg_dir: str, batch: int, count: int) -> list[EncodedImages]:
    """``count`` shuffled batches of the JPEG dataset, still encoded (as a device decoder gets them)."""
    out: list[EncodedImages] = []
    while len(out) < count:
        for item in ShardDataset(jpeg_dir, batch, shuffle=True, seed=len(out), decode="device"):
            out.append(item["image"])
            if len(out) == count:
                break
    return out
