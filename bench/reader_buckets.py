"""Reader samples/s on a bucketed dataset against the centre-crop dataset of the same pixel budget.

``python -m bench.reader_buckets [DIR] [--samples N] [--rounds R]`` (also ``python -m bench.reader --buckets``)
writes two datasets of ``N`` random-pixel samples each (into DIR, or a temp dir): one of 256×256 (what
centre crop stores) and one bucketed (``mode: bucket``) at the same 256² budget, its samples spread over
five buckets from 192×320 to 320×192 as a photo corpus spreads over aspect ratios. Both are read shuffled
(the default order) in batches of 256, each batch copied once into a reused buffer (what ``pin_memory``
or ``.cuda()`` does with it), page cache warm; the rounds alternate between the two datasets so a drift of
the machine's bandwidth hits both, and the medians are reported with the ratio
``bucketed samples/s / centre samples/s`` (the figure: >= 0.9).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import numpy as np

from shardio import ShardDataset
from shardio.format import InputEntry, Manifest
from shardio.write.shard_writer import InputShardWriter, write_manifest

BUDGET = (256, 256)
# Sides multiples of 32, area within [0.9, 1.0] of the budget; shares of a LAION-like spread of aspects.
BUCKETS = ((320, 192), (288, 224), (256, 256), (224, 288), (192, 320))
SHARES = (0.1, 0.2, 0.35, 0.2, 0.15)
BATCH = 256
SAMPLES_PER_SHARD = 256


def build(directory: str, samples: int, buckets: tuple[tuple[int, int], ...] | None) -> str:
    """``samples`` random-pixel samples through the writer: one shape (``buckets=None``) or bucketed."""
    if os.path.exists(os.path.join(directory, "manifest.json")):
        return directory
    os.makedirs(directory, exist_ok=True)
    rng = np.random.default_rng(0)
    height, width = BUDGET
    config: dict[str, Any] = {"height": height, "width": width}
    if buckets is not None:
        config.update(mode="bucket", buckets=[list(b) for b in buckets])
        chosen = rng.choice(len(buckets), size=samples, p=SHARES)
    else:
        chosen = np.zeros(samples, np.int64)
    shapes = list(buckets) if buckets is not None else [BUDGET]
    manifest = Manifest(shape=(height, width, 3), config=config, versions={})
    writer = InputShardWriter(directory, "bench", height, width, SAMPLES_PER_SHARD,
                              buckets=None if buckets is None else list(buckets))
    tiles = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in shapes]
    for i, bucket in enumerate(chosen.tolist()):
        pixels = tiles[bucket].copy()
        pixels.reshape(-1)[:8] = rng.integers(0, 256, 8, dtype=np.uint8)  # content does not matter to a copy
        meta = {"key": f"{i:07d}", "cls": i % 1000}
        if buckets is None:
            writer.add(pixels, meta, "bench.tar")
        else:
            writer.add(pixels, meta, "bench.tar", bucket=bucket)
    manifest.shards = writer.close("bench.tar")
    manifest.inputs["bench.tar"] = InputEntry(0, 0, samples, 0, [e.path for e in manifest.shards])
    write_manifest(directory, manifest)
    return directory


def read_epoch(ds: ShardDataset, out: np.ndarray) -> tuple[int, int]:
    """(samples, bytes) of one epoch, each batch copied into ``out``."""
    samples = nbytes = 0
    flat = out.reshape(-1)
    for batch in ds:
        image = batch["image"].numpy()
        np.copyto(flat[: image.size].reshape(image.shape), image)
        samples += len(image)
        nbytes += image.nbytes
    return samples, nbytes


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", nargs="?", help="where to write (reuse) the two datasets (default: a temp dir)")
    parser.add_argument("--samples", type=int, default=4096, help="samples in each dataset")
    parser.add_argument("--rounds", type=int, default=5, help="timed epochs of each, alternating")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    with tempfile.TemporaryDirectory(prefix="shardio-bench-buckets-") as tmp:
        root = args.directory or tmp
        centre = build(os.path.join(root, "centre"), args.samples, None)
        bucketed = build(os.path.join(root, "bucketed"), args.samples, BUCKETS)
        datasets = {"centre": ShardDataset(centre, BATCH, shuffle=True),
                    "bucketed": ShardDataset(bucketed, BATCH, shuffle=True)}
        out = np.empty(BATCH * BUDGET[0] * BUDGET[1] * 3, np.uint8)
        times: dict[str, list[float]] = {name: [] for name in datasets}
        sizes: dict[str, tuple[int, int]] = {}
        for name, ds in datasets.items():
            sizes[name] = read_epoch(ds, out)  # warm-up: page cache and buffers
        for _ in range(args.rounds):
            for name, ds in datasets.items():
                start = time.perf_counter()
                read_epoch(ds, out)
                times[name].append(time.perf_counter() - start)
        rows = {}
        for name in datasets:
            seconds = statistics.median(times[name])
            rows[name] = {"samples/s": sizes[name][0] / seconds, "GB/s": sizes[name][1] / seconds / 1e9,
                          "batches": len(datasets[name])}
        result = {"samples": args.samples, "batch": BATCH, "rounds": args.rounds, "rows": rows,
                  "buckets": [list(b) for b in BUCKETS],
                  "bucket_sizes": datasets["bucketed"].bucket_sizes,
                  "bucketed_over_centre": rows["bucketed"]["samples/s"] / rows["centre"]["samples/s"]}
    for name, row in rows.items():
        print(f"{name:>9}: {row['samples/s']:9.0f} samples/s  {row['GB/s']:6.2f} GB/s  {row['batches']} batches")
    print(f"bucketed / centre samples/s: {result['bucketed_over_centre']:.3f}")
    return result


if __name__ == "__main__":
    main()
