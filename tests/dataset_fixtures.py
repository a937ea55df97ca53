"""Self-identifying datasets for the ShardDataset tests, written with shardio's writer (no Pillow, no Ray).

Sample ``i`` (its global index in stored order) has ``i`` in base 256 in its first three pixel bytes, the
rest of its pixels filled with ``i % 251``, ``cls = i`` and ``key = "s{i:06d}"``: one comparison of the
indices a test reads back catches missing, duplicated and reordered samples.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from shardio.format import InputEntry, Manifest, RetiredFile
from shardio.format.manifests import load_manifest
from shardio.write.shard_writer import InputShardWriter, write_manifest

# 117 samples from three inputs in shards of 8: every input ends in a partial shard (40 = 5×8, 45, 32).
AWKWARD_INPUTS = (40, 45, 32)


def self_identifying_pixels(index: int, height: int, width: int) -> np.ndarray:
    """Sample ``index``'s pixels: its index in the first three bytes, the rest ``index % 251``."""
    pixels = np.full((height, width, 3), index % 251, dtype=np.uint8)
    pixels.reshape(-1)[:3] = [index & 255, (index >> 8) & 255, (index >> 16) & 255]
    return pixels


def write_inputs(
    directory: str,
    inputs: tuple[int, ...],
    meta_for: Callable[[int, int, str], dict[str, Any]],
    *,
    height: int,
    width: int,
    samples_per_shard: int = 8,
    config: dict[str, Any] | None = None,
    pixels_for: Callable[[int], np.ndarray] | None = None,
    first_index: int = 0,
) -> Manifest:
    """A dataset as the job writes one, without Ray or Pillow: input ``n`` (``input-{n}.tar``) holds
    ``inputs[n]`` samples; sample ``i`` gets ``pixels_for(i)`` (default: self-identifying) and the metadata
    line ``meta_for(i, n, tar name)``. Returns the committed manifest."""
    manifest = Manifest(shape=(height, width, 3), config=config or {"height": height, "width": width},
                        versions={"shardio": "test"})
    index = first_index
    for number, count in enumerate(inputs):
        name = f"input-{number}.tar"
        writer = InputShardWriter(directory, f"input-{number}", height, width, samples_per_shard)
        for _ in range(count):
            pixels = pixels_for(index) if pixels_for else self_identifying_pixels(index, height, width)
            writer.add(pixels, meta_for(index, number, name), name)
            index += 1
        entries = writer.close(name)
        manifest.shards.extend(entries)
        manifest.inputs[name] = InputEntry(size=count, mtime_ns=0, samples=count, failed=0,
                                           shards=[e.path for e in entries])
    os.makedirs(directory, exist_ok=True)
    write_manifest(directory, manifest)
    return manifest


def make_dataset(
    directory: str,
    inputs: tuple[int, ...] = AWKWARD_INPUTS,
    *,
    samples_per_shard: int = 8,
    height: int = 8,
    width: int = 8,
    txt: bool = True,
    json_field: bool = False,
) -> Manifest:
    """Write a dataset of ``sum(inputs)`` self-identifying samples into ``directory``; return its manifest."""
    def meta_for(index: int, number: int, name: str) -> dict[str, Any]:
        return {"key": f"s{index:06d}", "tar": name, "member": f"{index}.jpg", "width": width, "height": height,
                "cls": index, "txt": f"caption {index}" if txt else None,
                "json": {"i": index} if json_field else None}

    return write_inputs(directory, inputs, meta_for, height=height, width=width,
                        samples_per_shard=samples_per_shard)


def indices(batch: dict[str, Any]) -> np.ndarray:
    """The stored indices of a batch's samples, read from the pixels; checks label and key agree."""
    image = batch["image"]
    assert image.dtype == torch.uint8 and image.ndim == 4 and image.shape[-1] == 3
    head = image.reshape(image.shape[0], -1)[:, :3].numpy().astype(np.int64)
    found = head[:, 0] + (head[:, 1] << 8) + (head[:, 2] << 16)
    assert (batch["cls"].numpy() == found).all(), "label and pixels disagree"
    assert batch["__key__"] == [f"s{i:06d}" for i in found], "keys and pixels disagree"
    return found


def epoch_indices(batches: list[dict[str, Any]]) -> list[np.ndarray]:
    return [indices(b) for b in batches]


def assert_exactly_once(seen: np.ndarray, samples: int) -> None:
    """Three separate failures, as in Mosaic's resumption tests: missing, duplicated, out of range."""
    seen = np.asarray(seen)
    counts = np.bincount(seen, minlength=samples)
    assert len(counts) == samples, f"indices beyond the dataset: {sorted(set(seen[seen >= samples]))}"
    missing = np.flatnonzero(counts == 0)
    assert missing.size == 0, f"{missing.size} samples missing, e.g. {missing[:10].tolist()}"
    duplicated = np.flatnonzero(counts > 1)
    assert duplicated.size == 0, f"{duplicated.size} samples duplicated, e.g. {duplicated[:10].tolist()}"


def retire_input(directory: str, name: str) -> int:
    """Drop one input as a run does (its files retired, kept by retention, not deleted) and commit; returns
    the new generation."""
    manifest = load_manifest(directory)
    gone = manifest.inputs.pop(name)
    for entry in [e for e in manifest.shards if e.path in gone.shards]:
        manifest.retired += [RetiredFile(entry.path), RetiredFile(entry.meta_path)]
    manifest.shards = [e for e in manifest.shards if e.path not in gone.shards]
    return write_manifest(directory, manifest)


def flip_bits(path: str, offset: int, mask: int = 0x01) -> None:
    """Corrupt one byte of a file in place (same size: only a checksum can tell)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ mask]))
