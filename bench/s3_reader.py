"""``ShardDataset`` streaming from the bench's S3 server with a bounded cache, against the local reader.

Every epoch is shuffled with the default window and block (the training setting), batches of 256, each
batch copied once into a reused buffer (what ``pin_memory`` or ``.cuda()`` does with it), so the local,
cold and warm rows do the same work per sample. Rows:

- ``download_path``: the cache's way of fetching without the reader (``Storage.download`` of each shard
  into a file, checksum taken as it streams, 4 threads): MB/s between the raw GET and the cold epoch;
- ``cold``: a fresh ``cache_dir`` with room for the whole dataset (``cache_limit`` = 1.25x its bytes):
  the first epoch downloads every shard; ``warm``: the next three epochs on the same dataset object,
  every shard already cached, so they should read at local speed;
- ``local``: the same shards on local disk (page cache warm, after a warm-up epoch), one epoch before
  each warm one (interleaved: a shared machine drifts), medians;
- ``bounded``: a fresh ``cache_dir`` whose ``cache_limit`` holds 60% of the shards (of 16: room for the
  default shuffle window of 8 and a few ahead), two epochs: the cache must evict and download again, and
  never exceed its limit.

The cache's size is sampled from outside every 20 ms (every file under ``cache_dir``, partial
downloads included), so the peak does not rely on the cache reporting itself; the figure is the larger
of that and the cache's own ``cache_stats()["peak_bytes"]``. The cache is another
module's work: if ``ShardDataset`` has no ``cache_dir`` yet, or refuses an ``s3://`` URL, the rows say
"not available" with the reason instead of failing the bench.
"""

from __future__ import annotations

import inspect
import os
import shutil
import statistics
import time
import traceback
from typing import Any

import numpy as np

from bench.job_bench import _Sampler
from bench.copy_baseline import copy_batches
from shardio.errors import ShardioError

# What the S3 reader raises when it cannot serve these rows (shardio's tree: a cache_limit it refuses, a
# failed download; the OS's; arguments it does not take yet). Anything else is a bug and stops the bench.
READER_FAILURES = (ShardioError, OSError, ValueError, TypeError, AttributeError)

__all__ = ["CacheSizeSampler", "reader_rows"]

BATCH = 256
try:  # the cache's own number of download threads, so this row measures what the reader does
    from shardio.read.cache.cache_units import DOWNLOAD_THREADS
except ImportError:
    DOWNLOAD_THREADS = 4
BOUNDED_MIN_SHARDS = 9  # the default shuffle window (8 shards) and one ahead


class CacheSizeSampler(_Sampler):
    """Peak total bytes of the files under ``directory``, sampled every ``interval_s`` in a thread."""

    def __init__(self, directory: str, interval_s: float = 0.02) -> None:
        super().__init__(interval_s)
        self.directory = directory
        self.peak = 0
        self.samples = 0

    def size(self) -> int:
        total = 0
        for root, _, files in os.walk(self.directory):
            for name in files:
                try:
                    total += os.lstat(os.path.join(root, name)).st_size
                except FileNotFoundError:  # evicted or renamed between listing and stat
                    pass
        return total

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.size())
            self.samples += 1
            self._stop.wait(self.interval_s)

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        self.peak = max(self.peak, self.size())


def _epoch(dataset: Any, out: np.ndarray) -> dict[str, float]:
    start = time.perf_counter()
    batches = iter(dataset)
    first = next(batches)
    first_s = time.perf_counter() - start
    samples = copy_batches([first], out) + copy_batches(batches, out)
    seconds = time.perf_counter() - start
    return {"samples": samples, "seconds": round(seconds, 3), "samples/s": round(samples / seconds, 1),
            "first_batch_s": round(first_s, 3)}


def _median_row(epochs: list[dict[str, float]]) -> dict[str, Any]:
    """Medians over ``epochs``: whole epochs, and ``steady`` (each epoch less its first batch: a 2,560-sample
    epoch lasts ~0.1 s warm, so a start-of-epoch cost of a few ms, nothing in a real epoch, weighs 10-20%)."""
    steady = [(e["samples"] - BATCH) / (e["seconds"] - e["first_batch_s"]) for e in epochs if e["samples"] > BATCH]
    return {"samples/s": round(statistics.median(e["samples/s"] for e in epochs), 1),
            "steady_samples/s": round(statistics.median(steady), 1) if steady else None,  # None: one batch
            "first_batch_s": round(statistics.median(e["first_batch_s"] for e in epochs), 4), "epochs": epochs}


def download_path(url: str, scratch: str, threads: int = DOWNLOAD_THREADS) -> dict[str, Any]:
    """MB/s of the cache's way to fetch a shard without the reader: ``Storage.download`` of each shard
    object into a file, checksum included (its return value), ``threads`` at a time (the cache's
    default). Between the raw GET (bytes into memory) and the cold epoch: says whether a gap is the
    download or the rest."""
    from concurrent.futures import ThreadPoolExecutor

    from shardio.store.backends import for_path
    from shardio.format.manifests import load_manifest

    store = for_path(url)
    manifest = load_manifest(url)
    directory = os.path.join(scratch, "download-path")
    shutil.rmtree(directory, ignore_errors=True)
    os.makedirs(directory)

    def fetch(index: int) -> int:
        local = os.path.join(directory, f"{index}.npy")
        entry = manifest.shards[index]
        if store.download(store.join(url, entry.path), local, entry.checksum_algorithm) != entry.checksum:
            raise RuntimeError(f"{entry.path}: {entry.checksum_algorithm} differs from the manifest")
        return os.path.getsize(local)

    start = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        nbytes = sum(pool.map(fetch, range(len(manifest.shards))))
    seconds = time.perf_counter() - start
    shutil.rmtree(directory, ignore_errors=True)
    return {"threads": threads, "bytes": nbytes, "seconds": round(seconds, 3),
            "MB/s": round(nbytes / seconds / 1e6, 1), "samples/s": round(nbytes / seconds / (256 * 256 * 3), 1)}


def _not_available() -> str | None:
    from shardio import ShardDataset

    if "cache_dir" not in inspect.signature(ShardDataset.__init__).parameters:
        return "not available: ShardDataset has no cache_dir/cache_limit on this branch (the reader cache)"
    return None


def _stats(dataset: Any) -> dict[str, int] | None:
    """The cache's own counters (``ShardDataset.cache_stats()``, the cache module's accessor)."""
    return dataset.cache_stats()


def _remote_epochs(url: str, cache_dir: str, cache_limit: int, epochs: int, out: np.ndarray,
                   local: Any = None) -> dict[str, Any]:
    """``epochs`` passes from a fresh ``cache_dir``; with ``local``, a local-disk epoch before each pass
    after the first (interleaved, so drift of a shared machine hits both rows alike)."""
    from shardio import ShardDataset

    shutil.rmtree(cache_dir, ignore_errors=True)
    os.makedirs(cache_dir)
    with CacheSizeSampler(cache_dir) as sampler:
        start = time.perf_counter()
        dataset = ShardDataset(url, BATCH, shuffle=True, cache_dir=cache_dir, cache_limit=cache_limit)
        open_s = time.perf_counter() - start
        rows, local_rows = [_epoch(dataset, out)], []
        for _ in range(epochs - 1):
            if local is not None:
                local_rows.append(_epoch(local, out))
            rows.append(_epoch(dataset, out))
        stats = _stats(dataset)
        del dataset
    # The cache's own count is the stricter one: it includes files evicted while still memory-mapped
    # (unlinked, so invisible to the sampler, but holding their blocks until unmapped).
    reported = stats.get("peak_bytes", 0) if isinstance(stats, dict) else 0
    peak = max(sampler.peak, reported)
    return {
        "open_s": round(open_s, 3),
        "epochs": rows,
        "local_epochs": local_rows,
        "cache_limit_bytes": cache_limit,
        "peak_cache_bytes": peak,
        "peak_over_limit": round(peak / cache_limit, 3),
        "peak_on_disk_sampled": sampler.peak,
        "size_samples": sampler.samples,
        "cache_stats": stats,
    }


def reader_rows(local_dir: str, url: str, scratch: str, dataset_bytes: int, shards: int) -> dict[str, Any]:
    """The rows above; ``dataset_bytes``, ``shards``: the shards' total size and count (set the limits)."""
    from shardio import ShardDataset

    out = np.empty((BATCH, 256, 256, 3), np.uint8)
    local = ShardDataset(local_dir, BATCH, shuffle=True)
    _epoch(local, out)  # warm-up: page cache, memory maps
    result: dict[str, Any] = {"batch": BATCH}
    why = _not_available()
    if why:
        result["local"] = _median_row([_epoch(local, out) for _ in range(3)])
        result["remote"] = why
        return result
    result["download_path"] = download_path(url, scratch)
    full_limit = int(dataset_bytes * 1.25)
    # A shuffled batch draws from up to shuffle_window (8) shards, which must be on disk together
    # (the cache refuses a smaller limit with a clear error): 60% of 16 shards leaves room for 9.
    bounded_limit = max(int(dataset_bytes * 0.6), (BOUNDED_MIN_SHARDS * dataset_bytes) // shards)
    try:
        full = _remote_epochs(url, os.path.join(scratch, "cache-full"), full_limit, 4, out, local)
        result["local"] = _median_row(full["local_epochs"])
        result["cold"] = {**full["epochs"][0], "open_s": full["open_s"]}
        result["warm"] = _median_row(full["epochs"][1:])
        result["full_cache"] = {k: v for k, v in full.items() if k not in ("epochs", "local_epochs")}
        if bounded_limit >= dataset_bytes:
            result["bounded"] = f"skipped: {shards} shards, too few for a cache smaller than the data that " \
                                f"holds {BOUNDED_MIN_SHARDS} of them"
        else:
            bounded = _remote_epochs(url, os.path.join(scratch, "cache-bounded"), bounded_limit, 2, out)
            result["bounded"] = {**_median_row(bounded["epochs"]),
                                 **{k: v for k, v in bounded.items() if k != "epochs"}}
    except READER_FAILURES as exc:  # the cache is another module's work in progress: report, keep going
        traceback.print_exc()
        result["remote"] = f"failed: {type(exc).__name__}: {exc}"
        result.setdefault("local", _median_row([_epoch(local, out) for _ in range(3)]))
    finally:
        for name in ("cache-full", "cache-bounded"):
            shutil.rmtree(os.path.join(scratch, name), ignore_errors=True)
    return result
