"""Reader figures for ``bench.run``: ``bench.reader`` on a dataset the job wrote, and the WebDataset + PIL
DataLoader over the source tars (what the shards replace).

``bench.reader.main`` times ``ShardDataset`` sequential and shuffled against ``np.copyto`` of the same bytes
in the same run; if its interface is not there (it is another module's), a minimal version runs here.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import numpy as np

__all__ = ["reader_figures", "webdataset_samples_per_s"]

BATCH = 256


def reader_figures(dataset_dir: str, quick: bool) -> dict[str, Any]:
    """{"sequential": row, "shuffled": row, "copyto": row, "rows": all rows, "source": ...}; a row has
    "GB/s", "samples/s" and "of copyto"."""
    try:
        from bench import reader

        result = reader.main([dataset_dir, "--no-webdataset"] + (["--quick"] if quick else []))
        rows = result["rows"]
        shuffled_name = next(n for n in rows if n.startswith("shuffle w="))  # the first is the default
        return {
            "sequential": rows["sequential"],
            "shuffled": rows[shuffled_name],
            "shuffled_setting": shuffled_name,
            "copyto": rows["copyto"],
            "rows": rows,
            "source": "bench.reader.main",
        }
    except (ImportError, AttributeError, KeyError, StopIteration, TypeError) as e:
        print(f"bench.reader unavailable or changed ({type(e).__name__}: {e}); measuring the reader here")
        return _minimal(dataset_dir, rounds=2 if quick else 5)


def _minimal(dataset_dir: str, rounds: int) -> dict[str, Any]:
    from shardio import ShardDataset
    from shardio.reader import open_dataset

    snapshot = open_dataset(dataset_dir)
    arrays = [np.array(snapshot.pixels(i)) for i in range(len(snapshot.shards))]
    total, samples = sum(a.nbytes for a in arrays), sum(len(a) for a in arrays)
    out = np.empty((BATCH, *snapshot.shape), np.uint8)

    def copyto() -> None:
        for a in arrays:
            for i in range(0, len(a), BATCH):
                np.copyto(out[: len(a[i : i + BATCH])], a[i : i + BATCH])

    def through(ds) -> None:
        for batch in ds:
            image = batch["image"].numpy()
            np.copyto(out[: len(image)], image)

    def timed(fn) -> float:
        fn()
        times = []
        for _ in range(rounds):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    rows = {}
    for name, fn in (
        ("copyto", copyto),
        ("sequential", lambda: through(ShardDataset(dataset_dir, BATCH))),
        ("shuffle (default)", lambda: through(ShardDataset(dataset_dir, BATCH, shuffle=True))),
    ):
        seconds = timed(fn)
        rows[name] = {"GB/s": total / seconds / 1e9, "samples/s": samples / seconds}
    for row in rows.values():
        row["of copyto"] = row["GB/s"] / rows["copyto"]["GB/s"]
    return {
        "sequential": rows["sequential"],
        "shuffled": rows["shuffle (default)"],
        "shuffled_setting": "shuffle (default)",
        "copyto": rows["copyto"],
        "rows": rows,
        "source": "bench",
    }


def webdataset_samples_per_s(pattern: str, workers: int, side: int) -> float | None:
    """Samples/s of ``examples/train.py``'s WebDataset + PIL DataLoader (full decode, resize, crop) over
    ``pattern``, worker start-up included (~0.1 s of several seconds). None if it cannot run here."""
    try:
        from bench.reader import _load_example

        train = _load_example()
        loader = train.webdataset_loader(pattern, batch_size=16, workers=workers, side=side, pin_memory=False)
    except (ImportError, AttributeError, FileNotFoundError) as e:
        print(f"WebDataset baseline skipped: {type(e).__name__}: {e}")
        return None
    start = time.perf_counter()
    samples = sum(len(batch["cls"]) for batch in loader)
    return samples / (time.perf_counter() - start)
