"""Self-identifying bucketed datasets (format version 4), written with shardio's writer (no Pillow for raw,
no Ray): what the reader, training and format tests of aspect-ratio buckets build on.

Sample ``g`` (0 .. total - 1, numbered in the order the inputs feed them to the writer) is in bucket
``b``; its key is ``f"b{b}-{g:06d}"``, ``cls = g``, its pixels are of bucket ``b``'s (h, w) and carry ``g``
as ``tests.dataset_fixtures`` pixels do (raw: ``g`` in the first three bytes, the rest ``g % 251``; JPEG:
flat, ``g``'s base-16 digits, so ``g < 4096``). ``tests.dataset_fixtures.pixel_indices`` reads ``g`` back
from a batch, ``key_bucket`` a key's bucket: a test checks every key once and one shape per batch.

The buckets' samples are interleaved (round robin over the buckets that still have samples, as a job
meets images of mixed aspect ratios), then cut into ``inputs`` consecutive inputs (``input-N.tar``), so
an input's shards hold several buckets and its partial shards are several.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from shardio.format import InputEntry, Manifest
from shardio.format.index import segment_bytes, segment_path
from shardio.write.shard_writer import InputShardWriter, write_manifest
from dataset_fixtures import encode_jpeg, jpeg_identifying_pixels, self_identifying_pixels

__all__ = ["make_bucketed_dataset", "bucket_config", "bucket_order", "key_bucket", "key_index",
           "swap_shard_buckets", "BUCKETS", "root", "write_root", "segment_arrays", "rewrite_segment"]

# Three shapes within a 16x16 budget (tall, square, wide): small enough for fast tests.
BUCKETS = ((20, 12), (16, 16), (12, 20))


def bucket_config(buckets: Sequence[tuple[int, int]], budget: tuple[int, int], encoding: str = "raw") -> dict[str, Any]:
    """A bucketed dataset's stored config, as the job resolves it: ``mode: bucket``, the list under ``buckets``."""
    config: dict[str, Any] = {"height": budget[0], "width": budget[1], "mode": "bucket",
                              "buckets": [[int(h), int(w)] for h, w in buckets], "bucket_step": 4,
                              "bucket_max_ratio": 4.0}
    if encoding == "jpeg":
        config.update(encoding="jpeg", quality=90, subsampling="4:4:4")
    elif encoding != "raw":
        config.update(encoding=encoding)
    return config


def bucket_order(samples: Sequence[int]) -> list[int]:
    """The bucket of each sample ``g`` in writing order: round robin over the buckets with samples left."""
    left = list(samples)
    order: list[int] = []
    while any(left):
        for bucket, count in enumerate(left):
            if count:
                order.append(bucket)
                left[bucket] -= 1
    return order


def key_bucket(key: str) -> int:
    """The bucket a fixture key names (``b{bucket}-{g:06d}``)."""
    return int(key[1:key.index("-")])


def key_index(key: str) -> int:
    """The sample number ``g`` a fixture key names."""
    return int(key[key.index("-") + 1:])


def make_bucketed_dataset(path: str, buckets: Sequence[tuple[int, int]] = BUCKETS,
                          samples: Sequence[int] = (20, 27, 13), *, samples_per_shard: int = 8,
                          encoding: str = "raw", inputs: int = 2, budget: tuple[int, int] | None = None) -> str:
    """Write a bucketed dataset of ``samples[b]`` samples in bucket ``b`` (of shape ``buckets[b]``) into
    ``path`` through the writer and the one commit (``InputShardWriter`` with ``bucket=``, then
    ``write_manifest``); ``budget`` (the root's ``shape``) defaults to the smallest square holding the largest
    bucket's area.
    Returns ``path``."""
    if len(samples) != len(buckets):
        raise ValueError(f"{len(samples)} sample counts for {len(buckets)} buckets")
    jpeg = encoding == "jpeg"
    if budget is None:
        side = math.isqrt(max(h * w for h, w in buckets) - 1) + 1
        budget = (side, side)
    manifest = Manifest(shape=(budget[0], budget[1], 3), config=bucket_config(buckets, budget, encoding),
                        versions={"shardio": "test"})
    order = bucket_order(samples)
    # a lossy encoding (JPEG; yuv420's halved chroma) keeps only a flat colour exact to a few levels
    identifying = jpeg_identifying_pixels if encoding in ("jpeg", "yuv420") else self_identifying_pixels
    cuts = np.linspace(0, len(order), inputs + 1).round().astype(int).tolist()
    os.makedirs(path, exist_ok=True)
    for number in range(inputs):
        name = f"input-{number}.tar"
        writer = InputShardWriter(path, f"input-{number}", budget[0], budget[1], samples_per_shard, encoding,
                                  buckets=list(buckets))
        for g in range(cuts[number], cuts[number + 1]):
            bucket = order[g]
            height, width = buckets[bucket]
            pixels = identifying(g, height, width)
            meta = {"key": f"b{bucket}-{g:06d}", "tar": name, "member": f"{g}.jpg", "width": 4 * width,
                    "height": 4 * height, "cls": g, "txt": f"caption {g}", "json": None}
            writer.add(encode_jpeg(pixels) if jpeg else pixels, meta, name, bucket=bucket)
        entries = writer.close(name)
        count = cuts[number + 1] - cuts[number]
        manifest.shards.extend(entries)
        manifest.inputs[name] = InputEntry(size=count, mtime_ns=0, samples=count, failed=0,
                                           shards=[e.path for e in entries])
    write_manifest(path, manifest)
    return path


def swap_shard_buckets(directory: str, first: int, second: int) -> None:
    """Forge the current root's index as an editor would: every segment's ``shard_bucket`` with ids ``first``
    and ``second`` exchanged (each segment renamed by its new sha256, ``manifest.json`` naming them), the
    shard files and every other column untouched. Two buckets of the same byte size (h x w and w x h) keep
    every listed size consistent: only the shards' headers tell."""
    manifest_path = os.path.join(directory, "manifest.json")
    with open(manifest_path, encoding="utf-8") as f:
        root = json.load(f)
    for segment in root["segments"]:
        with np.load(os.path.join(directory, segment["path"]), allow_pickle=False) as z:
            arrays = {name: z[name] for name in z.files}
        ids = arrays["shard_bucket"]
        swapped = np.where(ids == first, second, np.where(ids == second, first, ids))
        arrays["shard_bucket"] = swapped.astype(ids.dtype)
        data = segment_bytes(arrays)
        segment.update(path=segment_path(data), bytes=len(data))
        with open(os.path.join(directory, segment["path"]), "wb") as f:
            f.write(data)
    with open(manifest_path, "w", encoding="utf-8") as f:
        json.dump(root, f)


def root(directory: str) -> dict:
    """The dataset's root (``manifest.json``) as JSON."""
    with open(os.path.join(directory, "manifest.json")) as f:
        return json.load(f)


def write_root(directory: str, doc: dict) -> None:
    """Write ``doc`` as the root, as a forger or an old writer would."""
    with open(os.path.join(directory, "manifest.json"), "w") as f:
        json.dump(doc, f)


def segment_arrays(directory: str, rel: str) -> dict[str, np.ndarray]:
    """The arrays of index segment ``rel``."""
    with np.load(os.path.join(directory, rel), allow_pickle=False) as z:
        return {name: z[name] for name in z.files}


def rewrite_segment(directory: str, mutate) -> str:
    """Replace the root's (only) segment by ``mutate(arrays)``'s, renamed by its new sha256 as a forger
    would; returns its path."""
    doc = root(directory)
    assert len(doc["segments"]) == 1
    arrays = segment_arrays(directory, doc["segments"][0]["path"])
    mutate(arrays)
    data = segment_bytes(arrays)
    rel = segment_path(data)
    with open(os.path.join(directory, rel), "wb") as f:
        f.write(data)
    doc["segments"][0].update(path=rel, bytes=len(data))
    write_root(directory, doc)
    return rel
