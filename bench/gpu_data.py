"""The GPU check's datasets: the same photo-like images as a raw and as a JPEG dataset, written with shardio's
writer (no Ray, no Pillow-SIMD: the GPU machine's stock Pillow encodes, as the job's encoder would).

``distinct`` images (``preprocess.sample_data.photo_like``: soft shapes, texture and grain, ~1.5 bits/pixel
like a photo) are encoded once at the compact config (``configs/jpeg.yaml``: quality 90, 4:4:4) and repeated
up to ``samples``: a decode's cost depends on the bytes, not on whether it saw them before. The raw dataset
holds the JPEGs' CPU decodes, so both datasets carry the same pixels.
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
    manifest = Manifest(shape=(side, side, 3), config=config, versions={"shardio": "gpu-check"})
    writer = InputShardWriter(directory, "gpu", side, side, samples_per_shard, encoding)
    for index in range(samples):
        writer.add(items[index % len(items)], {"key": f"{index:08d}", "cls": index % 1000}, "gpu.tar")
    manifest.shards = writer.close("gpu.tar")
    manifest.inputs["gpu.tar"] = InputEntry(0, 0, samples, 0, [e.path for e in manifest.shards])
    write_manifest(directory, manifest)


def build(root: str, samples: int, distinct: int, side: int = 256, samples_per_shard: int = 1024,
          workers: int | None = None) -> GpuDatasets:
    """``root/raw`` and ``root/jpeg`` (made once: an existing pair is reused)."""
    raw, jpeg = os.path.join(root, "raw"), os.path.join(root, "jpeg")
    workers = workers or min(16, os.cpu_count() or 1)
    with ProcessPoolExecutor(workers) as pool:
        jpegs = list(pool.map(_encoded, [(i, side) for i in range(distinct)], chunksize=16))
        if not os.path.exists(os.path.join(jpeg, "manifest.json")):
            _write(jpeg, side, samples, samples_per_shard, jpegs, "jpeg")
        if not os.path.exists(os.path.join(raw, "manifest.json")):
            pixels = list(pool.map(_pixels, jpegs, chunksize=16))
            _write(raw, side, samples, samples_per_shard, pixels, "raw")
    return GpuDatasets(raw, jpeg, samples, side, float(np.mean([len(j) for j in jpegs])))


def encoded_batches(jpeg_dir: str, batch: int, count: int) -> list[EncodedImages]:
    """``count`` shuffled batches of the JPEG dataset, still encoded (as a device decoder gets them)."""
    out: list[EncodedImages] = []
    while len(out) < count:
        for item in ShardDataset(jpeg_dir, batch, shuffle=True, seed=len(out), decode="device"):
            out.append(item["image"])
            if len(out) == count:
                break
    return out
