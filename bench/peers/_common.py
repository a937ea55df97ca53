"""What both peer scripts share: the bench's images (read from shardio's shards with numpy alone), the
timing of one epoch, and the one JSON line the parent reads.

These scripts run inside ``bench/out/peer-venv`` (LitData and Mosaic Streaming are installed only there:
they pull stock Pillow, which must never replace the project venv's Pillow-SIMD), so they import neither
shardio nor the bench package: a shard is a ``.npy`` of ``[N, 256, 256, 3]`` uint8 and a ``.jsonl`` of one
``{"key", "cls"}`` line per sample, which is all they need to write the same images.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import sys
import time
from typing import Any

import numpy as np

RESULT_PREFIX = "PEER_RESULT "


class Samples:
    """The images and labels of a shardio dataset directory, by global index (memory-mapped)."""

    def __init__(self, dataset_dir: str) -> None:
        paths = sorted(glob.glob(os.path.join(dataset_dir, "shards", "*.npy")))
        if not paths:
            raise SystemExit(f"{dataset_dir}: no shards/*.npy")
        self.arrays = [np.load(p, mmap_mode="r") for p in paths]
        self.labels = []
        for path in paths:
            with open(path[: -len(".npy")] + ".jsonl") as f:
                self.labels.append([json.loads(line)["cls"] for line in f])
        self.offsets = np.cumsum([0] + [len(a) for a in self.arrays])

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def __getitem__(self, index: int) -> tuple[np.ndarray, int]:
        shard = int(np.searchsorted(self.offsets, index, side="right") - 1)
        row = index - int(self.offsets[shard])
        return np.ascontiguousarray(self.arrays[shard][row]), int(self.labels[shard][row])


def arguments(description: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--shards", required=True, help="shardio dataset directory (the images to write)")
    parser.add_argument("--remote", required=True, help="s3://bucket/prefix to write the peer's format to")
    parser.add_argument("--scratch", required=True, help="local folder for the peer's staging and cache")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--workers", type=int, default=2, help="DataLoader worker processes")
    parser.add_argument("--skip-write", action="store_true", help="read what an earlier call wrote to --remote")
    parser.add_argument("--epochs", type=int, default=3, help="the first is cold, the rest warm")
    return parser.parse_args()


def epoch(loader: Any, batch_key: str = "image") -> dict[str, float]:
    """Samples/s of one pass over ``loader`` (worker start-up included, as in the shardio rows)."""
    start = time.perf_counter()
    samples, first = 0, None
    for batch in loader:
        samples += len(batch[batch_key])
        first = first or time.perf_counter() - start
    seconds = time.perf_counter() - start
    return {"samples": samples, "seconds": round(seconds, 3), "samples/s": round(samples / seconds, 1),
            "first_batch_s": round(first or seconds, 3)}


def read_epochs(args: argparse.Namespace, count: int, make_loader: Any) -> dict[str, Any]:
    """``--epochs`` passes over ``make_loader(workers, cache_dir)`` from a fresh cache (one setting per
    process: a second Mosaic dataset in the same process once waited ~60 s for its first batch)."""
    # A cache folder of this process's own: Mosaic keys its shared memory and locks by the local path, so
    # no process sees another's files or locks (a suspect, ruled out, of a ~61 s first-batch stall).
    cache = os.path.join(args.scratch, f"cache-{args.workers}-{os.getpid()}")
    shutil.rmtree(cache, ignore_errors=True)
    loader = make_loader(args.workers, cache)
    epochs = [epoch(loader) for _ in range(args.epochs)]
    for e in epochs:
        if e["samples"] != count:
            raise SystemExit(f"an epoch read {e['samples']} samples of {count}")
    return {"workers": args.workers, "epochs": epochs, "cache_bytes": cache_bytes(cache)}


def cache_bytes(directory: str) -> int:
    total = 0
    for root, _, files in os.walk(directory):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except FileNotFoundError:
                pass
    return total


def emit(result: dict[str, Any]) -> None:
    print(RESULT_PREFIX + json.dumps(result), flush=True)
    sys.stdout.flush()
