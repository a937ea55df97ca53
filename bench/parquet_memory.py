"""Peak memory of reading a large Parquet file as samples: bounded by a row group, not by the file.

    python -m bench.parquet_memory [--gb 2] [--row-group-mb 32]

Writes a Parquet file of ``--gb`` GB of 300 KB image cells (random bytes: the reader hands cells over
undecoded, so this measures the reading alone) in row groups of ``--row-group-mb`` MB, then walks every
sample with ``preprocess.inputs.parquet_samples.iter_parquet_samples`` in a fresh process and reports the largest
RSS seen while reading (sampled at each sample) against the file's size. The file is written to
``$SHARDIO_SCRATCH`` (else the temp dir) and removed.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

CELL_BYTES = 300_000


def write(path: str, gigabytes: float, row_group_mb: int) -> int:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows_per_group = max(1, row_group_mb * 1_000_000 // CELL_BYTES)
    groups = max(1, int(gigabytes * 1e9 / (rows_per_group * CELL_BYTES)))
    rng = np.random.default_rng(0)
    schema = pa.schema([("key", pa.string()), ("jpg", pa.binary()), ("caption", pa.string())])
    with pq.ParquetWriter(path, schema, compression="none") as writer:
        for group in range(groups):
            cells = [rng.bytes(CELL_BYTES) for _ in range(rows_per_group)]
            keys = [f"{group:05d}{row:05d}" for row in range(rows_per_group)]
            writer.write_table(pa.table({"key": keys, "jpg": cells, "caption": ["a caption"] * rows_per_group},
                                        schema=schema), row_group_size=rows_per_group)
    return groups * rows_per_group


def walk(path: str) -> None:
    """The child: every sample of the file, then its RSS before reading, the largest RSS seen while reading
    (sampled at every sample) and the time, as one line."""
    import psutil
    import pyarrow.parquet  # noqa: F401 - imported before the baseline: the reading's own memory is measured

    from preprocess.config import JobConfig
    from preprocess.inputs.parquet_samples import iter_parquet_samples

    process = psutil.Process()
    baseline = peak = process.memory_info().rss
    started = time.perf_counter()
    count = 0
    for _ in iter_parquet_samples(path, JobConfig()):
        count += 1
        peak = max(peak, process.memory_info().rss)
    print(f"{count} {baseline} {peak} {time.perf_counter() - started:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=2.0)
    parser.add_argument("--row-group-mb", type=int, default=32)
    parser.add_argument("--walk", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.walk:
        walk(args.walk)
        return
    folder = os.environ.get("SHARDIO_SCRATCH") or tempfile.gettempdir()
    path = os.path.join(folder, f"parquet-memory-{os.getpid()}.parquet")
    try:
        rows = write(path, args.gb, args.row_group_mb)
        size = os.path.getsize(path)
        done = subprocess.run([sys.executable, "-m", "bench.parquet_memory", "--walk", path], check=True,
                              capture_output=True, text=True)
        count, baseline, peak, seconds = done.stdout.split()
        assert int(count) == rows, (count, rows)
        mb = 1e6
        print(f"file {size / mb:,.0f} MB, {rows} rows in row groups of {args.row_group_mb} MB: read in {seconds} s; "
              f"largest RSS while reading {int(peak) / mb:,.0f} MB (after imports {int(baseline) / mb:,.0f} MB: "
              f"+{(int(peak) - int(baseline)) / mb:,.0f} MB)")
    finally:
        if os.path.exists(path):
            os.remove(path)


if __name__ == "__main__":
    main()
