"""Shuffle quality against a permutation and Mosaic's py1e, and what it costs the reader, over a grid of
(window, block) settings: ``python -m bench.shuffle [--rounds 5] [--side 256] [--quality-only]``.

Quality (``shardio.read.shuffle_quality``, from the epoch order alone): mean distinct source shards per batch
of 256 and stored-neighbour pairs per batch, on synthetic layouts (200 and 2,000 shards of 1,000
samples; no pixels), for shardio's order (versions 1 and 2), the exact expectation of a uniform
permutation, and Mosaic Streaming's py1e (``py1e`` below) at its default block of 262,144 samples.

Speed: ``ShardDataset`` epochs over 64 shards × 32 random 256×256 images (403 MB, page cache warm),
every batch copied once more into a reused buffer (what pinning does), against ``np.copyto`` of the same
bytes; ``--fresh`` reads each epoch with a new dataset, so every shard is mapped once an epoch, as in a
dataset larger than the maps a reader keeps open. The machine is shared, so each round times copyto and every
setting back to back, and the ratio of each round is taken before the median (min-max shown); ``best`` is the
fastest epoch over the fastest copy, and ``samples/s`` the fastest epoch's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from typing import Any

import numpy as np
import torch

from bench.copy_baseline import BATCH, InMemoryImage, build, copy_batches, warm
from shardio import ShardDataset
from shardio.read.order import epoch_runs
from shardio.read.shuffle_quality import permutation_quality, runs_order, shuffle_quality

LAYOUTS = [(200, 1000), (2000, 1000)]  # (shards, samples per shard)
# (order version, window, block): version 1's (8, 16) was the default; version 2's (256, 1) is.
SETTINGS = [(1, 8, 16), (2, 8, 16), (2, 8, 1), (2, 64, 16), (2, 64, 4), (2, 64, 1), (2, 256, 4), (2, 256, 1),
            (2, 512, 1), (2, 1024, 1)]
SPEED_SHARDS, SPEED_SAMPLES_PER_SHARD = 64, 32
SPEED_SETTINGS = [(1, 8, 16), (2, 8, 16), (2, 8, 4), (2, 8, 1), (2, 64, 16), (2, 64, 4), (2, 64, 1)]
PY1E_BLOCK = 1 << 18  # Mosaic Streaming's default shuffle_block_size


def py1e(shard_sizes: np.ndarray, seed: int, epoch: int, block_size: int = PY1E_BLOCK) -> np.ndarray:
    """Mosaic Streaming's py1e epoch order (global sample ids), one canonical node, as one rank with one
    worker reads it. Written from our reading of ``streaming/base/shuffle/py1e.py`` (not copied): shard
    spans are shuffled once per run (``seed``), again per epoch within the node (``seed + epoch``), then
    every sample is moved by a uniform random shift of at most ``block_size / 2`` positions, clipped to
    the node, and the samples are stably sorted by their shifted positions. Details such as the exact
    random calls differ from Mosaic's, so the orders are not theirs sample for sample; the statistics are."""
    starts = np.concatenate([[0], np.cumsum(shard_sizes)[:-1]])
    spans = list(zip(starts.tolist(), (starts + shard_sizes).tolist()))
    np.random.default_rng(seed).shuffle(spans)
    epoch_rng = np.random.default_rng(seed + epoch)
    epoch_rng.shuffle(spans)
    ids = np.concatenate([np.arange(a, b) for a, b in spans])
    cutoff = block_size // 2
    positions = np.arange(len(ids))
    low = np.maximum(-cutoff, -positions)
    high = np.minimum(cutoff, len(ids) - 1 - positions)
    shifted = positions + epoch_rng.integers(low, high + 1)
    return ids[np.argsort(shifted, kind="stable")]


def quality_rows(shards: int, samples_per_shard: int, batch: int = BATCH) -> dict[str, dict[str, float]]:
    counts = np.full(shards, samples_per_shard)
    source = np.repeat(np.arange(shards), samples_per_shard)
    reference = permutation_quality(counts, batch)
    rows = {"permutation (exact)": _quality(reference, reference)}
    rows["mosaic py1e, block 262144"] = _quality(shuffle_quality(py1e(counts, 0, 0), source, batch), reference)
    for version, window, block in SETTINGS:
        runs = epoch_runs(counts, shuffle=True, seed=0, epoch=0, shuffle_window=window, shuffle_block=block,
                          order_version=version)
        rows[_name(version, window, block)] = _quality(
            shuffle_quality(runs_order(runs, counts), source, batch), reference)
    return rows


def _quality(measured: Any, reference: Any) -> dict[str, float]:
    return {"sources/batch": measured.sources_per_batch, "of permutation": measured.sources_share(reference),
            "neighbours/batch": measured.neighbours_per_batch, "neighbour rate": measured.neighbour_rate}


def _name(version: int, window: int, block: int) -> str:
    return f"v{version} window {window} block {block}"


def speed_rows(directory: str, rounds: int, fresh: bool) -> dict[str, dict[str, float]]:
    arrays = warm(directory)
    out = np.empty((BATCH, *arrays[0].shape[1:]), np.uint8)
    whole = np.concatenate(arrays)  # in-memory batches of 256 for copyto (the shards hold 32 each)
    in_memory = [{"image": InMemoryImage(whole[i : i + BATCH])} for i in range(0, len(whole), BATCH)]
    samples = len(whole)
    settings: dict[str, dict[str, Any]] = {"sequential": {}}
    for version, window, block in SPEED_SETTINGS:
        settings[_name(version, window, block)] = {"shuffle": True, "shuffle_window": window,
                                                   "shuffle_block": block, "order_version": version}

    reused = {name: ShardDataset(directory, BATCH, **kwargs) for name, kwargs in settings.items()}

    def epoch(name: str) -> float:
        # fresh: a new dataset each epoch, so every shard is mapped (and its metadata parsed) once an
        # epoch, as in a dataset larger than the maps a reader keeps open (2 x window, at least 16).
        ds = ShardDataset(directory, BATCH, **settings[name]) if fresh else reused[name]
        return _seconds(lambda: copy_batches(ds, out))

    for name in settings:
        epoch(name)  # untimed warm-up
    copies: dict[str, list[float]] = {name: [] for name in settings}
    epochs: dict[str, list[float]] = {name: [] for name in settings}
    for _ in range(rounds):
        for name in settings:
            copies[name].append(_seconds(lambda: copy_batches(in_memory, out)))
            epochs[name].append(epoch(name))
    rows = {}
    for name in settings:
        ratios = [c / e for c, e in zip(copies[name], epochs[name])]
        # best: fastest epoch over fastest copy, the least disturbed pair on a shared machine.
        rows[name] = {"of copyto": statistics.median(ratios), "min": min(ratios), "max": max(ratios),
                      "best": min(copies[name]) / min(epochs[name]), "samples/s": samples / min(epochs[name])}
    return rows


def _seconds(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--side", type=int, default=256, help="image side of the speed dataset")
    parser.add_argument("--quality-only", action="store_true", help="no speed grid (no pixels written)")
    parser.add_argument("--fresh", action="store_true", help="a new dataset (new memory maps) each epoch")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch intra-op threads (0: torch's default); on a loaded machine 2 threads on "
                             "2 cores collapse torch.cat (0.02-0.2 of copyto): the figures used 1")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    result: dict[str, Any] = {"batch": BATCH, "quality": {
        f"{shards} shards x {per}": quality_rows(shards, per) for shards, per in LAYOUTS}}
    if not args.quality_only:
        with tempfile.TemporaryDirectory(prefix="shardio-bench-shuffle-") as tmp:
            build(tmp, SPEED_SHARDS, SPEED_SAMPLES_PER_SHARD, args.side)
            result["speed"] = {"dataset": f"{SPEED_SHARDS} shards x {SPEED_SAMPLES_PER_SHARD}, {args.side}^2",
                               "rounds": args.rounds, "threads": torch.get_num_threads(),
                               "maps": "fresh each epoch" if args.fresh else "reused",
                               "rows": speed_rows(tmp, args.rounds, args.fresh)}
    _print(result)
    return result


def _print(result: dict[str, Any]) -> None:
    for layout, rows in result["quality"].items():
        print(f"\nquality, {layout} samples, batches of {result['batch']}")
        _table(rows, ["sources/batch", "of permutation", "neighbours/batch", "neighbour rate"])
    if "speed" in result:
        speed = result["speed"]
        print(f"\nspeed, {speed['dataset']}, batches of {result['batch']}, medians of {speed['rounds']} rounds, "
              f"{speed['threads']} torch threads, memory maps {speed['maps']}")
        _table(speed["rows"], ["of copyto", "min", "max", "best", "samples/s"])
    sys.stdout.flush()


def _table(rows: dict[str, dict[str, float]], columns: list[str]) -> None:
    print(f"{'':28}" + "".join(f"{c:>17}" for c in columns))
    for name, figures in rows.items():
        print(f"{name:28}" + "".join(f"{figures[c]:17.4g}" for c in columns))


if __name__ == "__main__":
    print(json.dumps(main(), indent=1))
