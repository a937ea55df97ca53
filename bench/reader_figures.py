"""Reader figures for ``bench.run``: ``bench.reader`` on a dataset the job wrote, and the WebDataset + PIL
DataLoader over the source tars (what the shards replace).

``bench.reader.main`` times ``ShardDataset`` sequential and shuffled against ``np.copyto`` of the same bytes
in the same run; if its interface is not there (it is another module's), a minimal version runs here.
"""

from __future__ import annotations

import time
from typing import Any

__all__ = ["reader_figures", "webdataset_samples_per_s"]


def reader_figures(dataset_dir: str, quick: bool) -> dict[str, Any]:
    """{"sequential": row, "shuffled": row, "copyto": row, "rows": all rows, "source": ...}; a row has
    "GB/s", "samples/s" and "of copyto" (measured by ``bench.reader``)."""
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
