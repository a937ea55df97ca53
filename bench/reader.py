"""Reader benchmark: ``ShardDataset`` bandwidth against ``np.copyto`` of the same bytes, and shuffle mixing.

``python -m bench.reader --shuffled-gather [--rounds 7] [--threads 1,2,4]``: the default shuffled read
against sequential and the old default order in one run, and the ways of assembling its batches
(``bench/gather.py``).

``python -m bench.reader --buckets [DIR] [--samples N]``: shuffled samples/s of a bucketed dataset against
the centre-crop dataset of the same budget (``bench/reader_buckets.py``).

``python -m bench.reader [DIR] [--quick] [--no-webdataset]`` writes (into DIR, or a temp dir) 8 shards × 256
random 256×256×3 images (403 MB), warms the page cache, then times, five rounds each, medians reported:

- ``copyto``: ``np.copyto`` of in-memory batches into one reused buffer: the memory bandwidth ceiling,
  measured in the same run because it varies 2× between runs on a shared machine (and ``torch copy_``,
  the same copy split over torch's intra-op threads, which is how ShardDataset assembles batches);
- ``ShardDataset`` sequential, and shuffled with several (window, block) settings: every batch is copied
  once into a reused buffer, which is what ``pin_memory`` or ``.cuda()`` does with it;
- ``ShardLoader`` with 2 workers (the batch crosses processes through shared memory);
- with CUDA: ``DeviceLoader`` to normalised float NCHW on the GPU, and a pinned batch's bare copy;
- a WebDataset + PIL decode ``DataLoader`` (2 workers) on LAION-like JPEGs, decoded and resized to the same
  256×256, as the baseline the shards replace.

Mixing, per setting, over one epoch's order: ``adjacent``: share of consecutive samples that were stored
next to each other (sequential 1.0, a full shuffle ~0); ``shards/batch``: distinct shards in a batch of
256; ``displacement``: mean |epoch position - stored position| over that of a uniform shuffle (N/3).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import numpy as np
import torch

from bench import gather, reader_buckets
from bench.copy_baseline import BATCH, SAMPLES_PER_SHARD, SHARDS, SIDE, InMemoryImage, build, copy_batches, warm
from shardio import DeviceLoader, ShardDataset, ShardLoader
from shardio.read.order import DEFAULT_SHUFFLE_BLOCK, DEFAULT_SHUFFLE_WINDOW

ROUNDS = 5
# (window, block); the first is the default (make bench's "reader shuffled" row); a window over the shard
# count is "all shards"; (8, 16) was the default before order version 2
SHUFFLES = [(DEFAULT_SHUFFLE_WINDOW, DEFAULT_SHUFFLE_BLOCK), (8, 16), (8, 64), (8, 4), (8, 1), (1, 16),
            (SHARDS * 4, 16)]


def timed(fn, rounds: int = ROUNDS) -> float:
    """Median seconds of ``fn()`` over ``rounds`` runs, after one untimed warm-up run."""
    fn()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def to_cuda(ds: ShardDataset) -> int:
    """Batches as normalised float NCHW on the GPU, through DeviceLoader (pinning thread, side stream)."""
    samples = 0
    for batch in DeviceLoader(ds, "cuda"):
        samples += len(batch["image"])
    torch.cuda.synchronize()
    return samples


def h2d(pinned: torch.Tensor, batches: int) -> None:
    for _ in range(batches):
        pinned.to("cuda", non_blocking=True)
    torch.cuda.synchronize()


def mixing(ds: ShardDataset) -> dict[str, float]:
    order = ds.sample_order(0)
    n = len(order)
    shard_of = np.searchsorted(ds.snapshot.offsets, order, side="right") - 1
    per_batch = [len(np.unique(shard_of[i : i + BATCH])) for i in range(0, n - BATCH + 1, BATCH)]
    return {
        "adjacent": float(np.mean(np.diff(order) == 1)),
        "shards_per_batch": float(np.mean(per_batch)),
        "displacement": float(np.mean(np.abs(order - np.arange(n))) / (n / 3)),
    }


def webdataset_samples_per_s(workers: int = 2, tars: int = 2, samples_per_tar: int = 48) -> float:
    """Samples/s of the WebDataset + PIL decode baseline on LAION-like JPEGs (from preprocess.sample_data)."""
    from preprocess.sample_data import make_sample_dataset  # needs Pillow: only for this baseline

    train = _load_example()
    data_dir = os.path.join("bench", "out", "webdataset-tars")
    make_sample_dataset(data_dir, tars=tars, samples_per_tar=samples_per_tar)
    loader = train.webdataset_loader(os.path.join(data_dir, "*.tar"), batch_size=16, workers=workers,
                                     side=SIDE, pin_memory=False)
    start = time.perf_counter()
    samples = sum(len(batch["cls"]) for batch in loader)  # worker start-up included: ~0.1 s of several
    return samples / (time.perf_counter() - start)


def _load_example() -> Any:
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "train.py")
    spec = importlib.util.spec_from_file_location("shardio_example_train", path)
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    return module


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args_given = sys.argv[1:] if argv is None else argv
    if "--buckets" in args_given:
        # A bucketed dataset against the centre-crop one of the same budget (bench/reader_buckets.py).
        return reader_buckets.main([a for a in args_given if a != "--buckets"])
    if "--shuffled-gather" in args_given:
        # The default shuffled read beside sequential and the old default (bench/gather.py).
        return gather.main([a for a in args_given if a != "--shuffled-gather"])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", nargs="?", help="dataset dir to create/reuse (default: a temp dir)")
    parser.add_argument("--quick", action="store_true", help="2 rounds, fewer shuffle settings")
    parser.add_argument("--no-webdataset", action="store_true", help="skip the WebDataset + PIL baseline")
    parser.add_argument("--side", type=int, default=SIDE, help="image side (small images: per-copy overhead)")
    parser.add_argument("--samples-per-shard", type=int, default=SAMPLES_PER_SHARD)
    args = parser.parse_args(argv)
    rounds = 2 if args.quick else ROUNDS
    with tempfile.TemporaryDirectory(prefix="shardio-bench-") as tmp:
        directory = build(args.directory or tmp, samples_per_shard=args.samples_per_shard, side=args.side)
        arrays = warm(directory)
        total = sum(a.nbytes for a in arrays)
        out = np.empty((BATCH, *arrays[0].shape[1:]), np.uint8)
        in_memory = [{"image": InMemoryImage(a[i : i + BATCH])} for a in arrays for i in range(0, len(a), BATCH)]
        rows: dict[str, dict[str, float]] = {}

        def row(name: str, seconds: float, samples: int, **extra: float) -> None:
            rows[name] = {"GB/s": total / seconds / 1e9, "samples/s": samples / seconds, **extra}

        samples = sum(len(a) for a in arrays)
        row("copyto", timed(lambda: copy_batches(in_memory, out), rounds), samples)
        flat = torch.from_numpy(out)
        tensors = [torch.from_numpy(batch["image"].numpy()) for batch in in_memory]
        row(f"torch copy_ ({torch.get_num_threads()} threads)",
            timed(lambda: [flat[: len(t)].copy_(t) for t in tensors], rounds), samples)
        sequential = ShardDataset(directory, BATCH)
        row("sequential", timed(lambda: copy_batches(sequential, out), rounds), samples, **mixing(sequential))
        for window, block in SHUFFLES[:2] if args.quick else SHUFFLES:
            ds = ShardDataset(directory, BATCH, shuffle=True, shuffle_window=window, shuffle_block=block)
            row(f"shuffle w={window} b={block}", timed(lambda ds=ds: copy_batches(ds, out), rounds), samples,
                **mixing(ds))
        loader = ShardLoader(ShardDataset(directory, BATCH, shuffle=True), num_workers=2)
        row("shuffle, 2 workers", timed(lambda: copy_batches(loader, out), rounds), samples)
        if torch.cuda.is_available():
            for name, ds in (("sequential -> cuda", sequential),
                             ("shuffle -> cuda", ShardDataset(directory, BATCH, shuffle=True))):
                row(name, timed(lambda ds=ds: to_cuda(ds), rounds), samples)
            pinned = torch.from_numpy(arrays[0][:BATCH]).pin_memory()
            row("pinned H2D (ceiling)", timed(lambda: h2d(pinned, len(in_memory)), rounds), samples)
        # copyto again: the machine's bandwidth drifts; the ratio uses the mean of both measurements.
        again = total / timed(lambda: copy_batches(in_memory, out), rounds) / 1e9
        rows["copyto"]["GB/s"] = (rows["copyto"]["GB/s"] + again) / 2
        rows["copyto"]["samples/s"] = rows["copyto"]["GB/s"] * 1e9 / (total / samples)
        for name, figures in rows.items():
            figures["of copyto"] = figures["GB/s"] / rows["copyto"]["GB/s"]
        result: dict[str, Any] = {"dataset_bytes": total, "batch": BATCH, "rounds": rounds, "rows": rows}
        if not args.no_webdataset:
            baseline = webdataset_samples_per_s()
            result["webdataset_pil_samples_per_s"] = baseline
            result["sequential_over_webdataset"] = rows["sequential"]["samples/s"] / baseline
            result["default_shuffle_over_webdataset"] = rows["shuffle w=8 b=16"]["samples/s"] / baseline
    _print(result)
    return result


def _print(result: dict[str, Any]) -> None:
    print(f"{result['dataset_bytes'] / 1e6:.0f} MB, batches of {result['batch']}, "
          f"medians of {result['rounds']} rounds")
    columns = ["GB/s", "samples/s", "of copyto", "adjacent", "shards_per_batch", "displacement"]
    print(f"{'':22}" + "".join(f"{c:>17}" for c in columns))
    for name, figures in result["rows"].items():
        cells = [f"{figures[c]:17.2f}" if c in figures else f"{'':17}" for c in columns]
        print(f"{name:22}" + "".join(cells))
    keys = ("webdataset_pil_samples_per_s", "sequential_over_webdataset", "default_shuffle_over_webdataset")
    for key in keys:
        if key in result:
            print(f"{key}: {result[key]:.1f}")
    sys.stdout.flush()


if __name__ == "__main__":
    print(json.dumps(main(), indent=1))
