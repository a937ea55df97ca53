"""Self-identifying datasets for the ShardDataset tests, written with shardio's writer (no Pillow, no Ray).

Sample ``i`` (its global index in stored order) has ``i`` in base 256 in its first three pixel bytes, the
rest of its pixels filled with ``i % 251``, ``cls = i`` and ``key = "s{i:06d}"``: one comparison of the
indices a test reads back catches missing, duplicated and reordered samples.

``encoding="jpeg"`` writes the same dataset as JPEG shards (``shardio.format.jpeg_shard``, encoded with
Pillow at the job's defaults). Exact bytes do not survive JPEG, so there sample ``i`` (< 4096) is a flat
image whose R, G, B hold its three base-16 digits as ``16 d + 8``: a flat 8×8-aligned block decodes
within ±4 of its colour (DC only, no ringing), so ``indices`` reads the digits back exactly.
"""

from __future__ import annotations

import json
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


JPEG_LIMIT = 4096  # three base-16 digits


def jpeg_identifying_pixels(index: int, height: int, width: int) -> np.ndarray:
    """Sample ``index``'s pixels in a JPEG dataset: flat, its base-16 digits as ``16 d + 8`` in R, G, B."""
    if not 0 <= index < JPEG_LIMIT:
        raise ValueError(f"a JPEG test dataset identifies samples 0..{JPEG_LIMIT - 1}, not {index}")
    digits = [16 * ((index >> shift) & 15) + 8 for shift in (0, 4, 8)]
    return np.broadcast_to(np.array(digits, np.uint8), (height, width, 3)).copy()


def jpeg_config(height: int, width: int) -> dict[str, Any]:
    return {"height": height, "width": width, "encoding": "jpeg", "quality": 90, "subsampling": "4:4:4"}


def encode_jpeg(pixels: np.ndarray) -> bytes:
    """The job's encoding of one image (Pillow, the dataset config's quality and subsampling)."""
    import io

    from PIL import Image  # only JPEG datasets need it: the raw fixtures stay numpy-only

    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "JPEG", quality=90, subsampling=0)
    return out.getvalue()


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
    encoding: str = "raw",
) -> Manifest:
    """A dataset as the job writes one, without Ray or Pillow: input ``n`` (``input-{n}.tar``) holds
    ``inputs[n]`` samples; sample ``i`` gets ``pixels_for(i)`` (default: self-identifying) and the metadata
    line ``meta_for(i, n, tar name)``. Returns the committed manifest."""
    jpeg = encoding == "jpeg"
    default_config = (jpeg_config(height, width) if jpeg
                      else {"height": height, "width": width, "encoding": encoding} if encoding == "yuv420"
                      else {"height": height, "width": width})
    manifest = Manifest(shape=(height, width, 3), config=config or default_config,
                        versions={"shardio": "test"})
    # a lossy encoding (JPEG; yuv420's halved chroma) keeps only a flat colour exact to a few levels
    identifying = jpeg_identifying_pixels if encoding in ("jpeg", "yuv420") else self_identifying_pixels
    index = first_index
    for number, count in enumerate(inputs):
        name = f"input-{number}.tar"
        writer = InputShardWriter(directory, f"input-{number}", height, width, samples_per_shard, encoding)
        for _ in range(count):
            pixels = pixels_for(index) if pixels_for else identifying(index, height, width)
            writer.add(encode_jpeg(pixels) if jpeg else pixels, meta_for(index, number, name), name)
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
    encoding: str = "raw",
) -> Manifest:
    """Write a dataset of ``sum(inputs)`` self-identifying samples into ``directory``; return its manifest."""
    def meta_for(index: int, number: int, name: str) -> dict[str, Any]:
        return {"key": f"s{index:06d}", "tar": name, "member": f"{index}.jpg", "width": width, "height": height,
                "cls": index, "txt": f"caption {index}" if txt else None,
                "json": {"i": index} if json_field else None}

    return write_inputs(directory, inputs, meta_for, height=height, width=width,
                        samples_per_shard=samples_per_shard, encoding=encoding)


def indices(batch: dict[str, Any]) -> np.ndarray:
    """The stored indices of a batch's samples, read from the pixels; checks label and key agree (a key
    ``s{i:06d}``, or in a bucketed dataset's batch ``b{bucket}-{i:06d}``, ``tests.bucket_fixtures``)."""
    image = batch["image"]
    assert image.dtype == torch.uint8 and image.ndim == 4 and image.shape[-1] == 3
    found = pixel_indices(image)
    assert (batch["cls"].numpy() == found).all(), "label and pixels disagree"
    prefix = f"b{int(batch['bucket'])}-" if "bucket" in batch else "s"
    assert batch["__key__"] == [f"{prefix}{i:06d}" for i in found], "keys and pixels disagree"
    return found


def pixel_indices(image: torch.Tensor) -> np.ndarray:
    """The indices uint8 [B, H, W, 3] samples carry: raw (``self_identifying_pixels``) or, when the pixels
    are not that pattern, a JPEG test dataset's (``jpeg_identifying_pixels``)."""
    flat = image.reshape(image.shape[0], -1).numpy().astype(np.int64)
    head = flat[:, :3]
    found = head[:, 0] + (head[:, 1] << 8) + (head[:, 2] << 16)
    if len(found) and not (flat[:, 3:] == (found % 251)[:, None]).all():
        found = np.array([_jpeg_index(sample) for sample in flat], dtype=np.int64)
    return found


def _jpeg_index(flat: np.ndarray) -> int:
    """The index a JPEG test sample carries (``jpeg_identifying_pixels``), checking every pixel is within
    the ±4 that a flat JPEG block decodes to (more means the decode is wrong, not noisy)."""
    pixels = flat.reshape(-1, 3)
    digits = pixels[0] // 16
    expected = 16 * digits + 8
    error = int(np.abs(pixels - expected).max())
    assert error <= 4, f"a JPEG test sample decodes {error} levels away from its flat colour {expected}"
    return int(digits[0] + (digits[1] << 4) + (digits[2] << 8))


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


def set_root_field(directory: str, name: str, value: Any) -> None:
    """Rewrite one field of the dataset's root (``manifest.json``), as a forger or an old writer would."""
    path = os.path.join(directory, "manifest.json")
    with open(path) as f:
        root = json.load(f)
    root[name] = value
    with open(path, "w") as f:
        json.dump(root, f)


def flip_bits(path: str, offset: int, mask: int = 0x01) -> None:
    """Corrupt one byte of a file in place (same size: only a checksum can tell)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ mask]))


def photo_like(index: int, side: int = 64) -> np.ndarray:
    """Smooth gradients plus mild noise, side x side: closer to a resized photo than flat test colours (every
    IDCT coefficient in use, so a JPEG decode shows its errors)."""
    rng = np.random.default_rng(index)
    y, x = np.mgrid[0:side, 0:side].astype(np.float64)
    image = np.stack([128 + 100 * np.sin(x / (5 + index % 7)), 128 + 90 * np.cos(y / 9 + index),
                      (x + y) * (255 / (2 * side))], axis=-1)
    return np.clip(image + rng.normal(0, 3, image.shape), 0, 255).astype(np.uint8)


def make_photo_dataset(directory: str, inputs: tuple[int, ...], side: int, samples_per_shard: int) -> Manifest:
    """A JPEG dataset of ``photo_like`` images (every IDCT coefficient in use: a GPU decode shows its
    errors), key ``s{index:06d}`` and label ``index`` each."""
    def meta_for(index: int, number: int, name: str) -> dict[str, Any]:
        return {"key": f"s{index:06d}", "tar": name, "member": f"{index}.jpg", "width": side, "height": side,
                "cls": index}

    return write_inputs(directory, inputs, meta_for, height=side, width=side, samples_per_shard=samples_per_shard,
                        pixels_for=lambda index: photo_like(index, side), encoding="jpeg")
