"""Synthetic batches of varying shape, as a bucketed dataset's DeviceLoader meets them (each batch one bucket's
[B, h, w, 3]), and the stand-ins that let the staging pools and the CUDA path's bookkeeping run without a GPU
(``StagingPools(allocate=...)``, events that say when they are done)."""

from __future__ import annotations

import io

import numpy as np
import torch
from PIL import Image

from shardio.read.jpeg_pixels import EncodedImages
from shardio.train.staging import StagingPools

__all__ = ["SHAPES", "mixed_batches", "FakeEvent", "plain_pools", "jpeg_batch"]

SHAPES = [(16, 24), (24, 16), (20, 20), (16, 24), (12, 32), (24, 16), (20, 20), (16, 24)]


def mixed_batches(shapes=SHAPES, batch: int = 4) -> list[dict]:
    """One batch per shape, each sample's pixels its running number (mod 251) plus the row, so a copy
    that lands in the wrong place or the wrong batch shows."""
    out, number = [], 0
    for index, (h, w) in enumerate(shapes):
        image = torch.empty((batch, h, w, 3), dtype=torch.uint8)
        for i in range(batch):
            image[i] = (number % 251) + torch.arange(h, dtype=torch.uint8)[:, None, None] % 4
            number += 1
        out.append({"image": image, "bucket": index % 3, "__key__": [f"s{number - batch + i}"
                                                                     for i in range(batch)]})
    return out


class FakeEvent:
    """A CUDA event stand-in: done when the test says so; ``synchronize`` (a wait) makes it done."""

    def __init__(self, done: bool = False) -> None:
        self.done, self.waited = done, 0

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.waited += 1
        self.done = True


def plain_pools(depth: int = 4) -> StagingPools:
    """Pools of plain (unpinned) CPU buffers."""
    return StagingPools(depth, allocate=lambda shape, dtype: torch.empty(shape, dtype=dtype))


def jpeg_batch(height: int, width: int, count: int, seed: int = 0) -> tuple[EncodedImages, np.ndarray]:
    """``count`` JPEGs of ``height`` x ``width`` made of 4x4 blocks (a JPEG keeps them near exactly), encoded as a
    batch, and their pixels."""
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, (count, height // 4, width // 4, 3), dtype=np.uint8)
    pixels = pixels.repeat(4, axis=1).repeat(4, axis=2)  # blocks: a JPEG keeps them near exactly
    jpegs = []
    for image in pixels:
        out = io.BytesIO()
        Image.fromarray(image).save(out, "JPEG", quality=95)
        jpegs.append(np.frombuffer(out.getvalue(), np.uint8).copy())
    return EncodedImages(jpegs, height, width, [(f"b-{height}x{width}.jpg.npy", 0, count)]), pixels
