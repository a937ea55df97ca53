"""What every reader benchmark measures against: random-byte shards written by the writer, their pixels
read back as in-memory arrays, and the one copy loop that times both (a batch copied once into a reused
buffer, as pinning or ``.cuda()`` does with it). ``bench.reader``, ``bench.gather``, ``bench.shuffle``,
``bench.s3_reader`` and ``bench.object_store`` share it, so none imports another's ``main``.
"""

from __future__ import annotations

import glob
import os

import numpy as np

from shardio.format import InputEntry, Manifest
from shardio.write.shard_writer import InputShardWriter, write_manifest

SIDE = 256
SHARDS = 8
SAMPLES_PER_SHARD = 256
BATCH = 256


def build(directory: str, shards: int = SHARDS, samples_per_shard: int = SAMPLES_PER_SHARD,
          side: int = SIDE) -> str:
    """Random-byte shards via the writer (pixels' content does not matter to a copy)."""
    if os.path.exists(os.path.join(directory, "manifest.json")):
        return directory
    rng = np.random.default_rng(0)
    manifest = Manifest(shape=(side, side, 3), config={"height": side, "width": side}, versions={})
    writer = InputShardWriter(directory, "bench", side, side, samples_per_shard)
    for i in range(shards * samples_per_shard):
        pixels = rng.integers(0, 256, (side, side, 3), dtype=np.uint8)
        writer.add(pixels, {"key": f"{i:07d}", "cls": i % 1000}, "bench.tar")
    manifest.shards = writer.close("bench.tar")
    manifest.inputs["bench.tar"] = InputEntry(0, 0, shards * samples_per_shard, 0,
                                              [e.path for e in manifest.shards])
    write_manifest(directory, manifest)
    return directory


def warm(directory: str) -> list[np.ndarray]:
    """Read every shard (page cache warm) and return the pixels as in-memory arrays, for copyto."""
    paths = sorted(glob.glob(os.path.join(directory, "shards", "*.npy")))
    return [np.load(p) for p in paths]


def copy_batches(batches, out: np.ndarray) -> int:
    samples = 0
    for batch in batches:
        image = batch["image"].numpy()
        np.copyto(out[: len(image)], image)
        samples += len(image)
    return samples


class InMemoryImage:
    """Stands in for a tensor in the copyto rows: the same ``.numpy()`` call, no torch in the timing."""

    def __init__(self, array: np.ndarray) -> None:
        self.array = array

    def numpy(self) -> np.ndarray:
        return self.array
