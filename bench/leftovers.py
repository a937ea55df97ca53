"""``clean_leftovers`` given the committed generation as a ``Manifest`` (``load_manifest``: an object per shard,
the listed paths as a set of strings) or as a ``DatasetIndex`` (``load_index``: columns; the listed paths
as sorted 64-bit hashes, ``shards/`` read 64k names at a time): time and peak Python memory (tracemalloc,
numpy's buffers included; a memory-mapped segment is page cache, not counted), load included.

A synthetic index of SHARDS shards (``bench.synthetic_index``), an empty file for each listed path
(``--no-files``: none, only the membership set-up and an empty listing) and ``--strays`` unlisted files,
which each call removes (recreated before each).

``python -m bench.leftovers [--shards 300000] [--strays 1000] [--dir DIR]``
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import tempfile
import time
import tracemalloc
from collections.abc import Callable

from bench.synthetic_index import write_index
from shardio.format.manifests import load_index, load_manifest
from shardio.write import directory as dataset_dir


def _strays(directory: str, count: int) -> None:
    for i in range(count):
        open(os.path.join(directory, "shards", f"stray-{i:06d}.npy"), "wb").close()


def _measure(directory: str, strays: int, load: Callable[[str], object]) -> tuple[float, float, int]:
    """(seconds, peak MB, files removed) of loading the generation and cleaning leftovers."""
    _strays(directory, strays)
    gc.collect()
    start = time.perf_counter()
    with dataset_dir.writing(directory):
        removed = dataset_dir.clean_leftovers(directory, load(directory)).removed
    seconds = time.perf_counter() - start
    _strays(directory, strays)
    gc.collect()
    tracemalloc.start()
    with dataset_dir.writing(directory):
        dataset_dir.clean_leftovers(directory, load(directory))
    peak = tracemalloc.get_traced_memory()[1] / 1e6
    tracemalloc.stop()
    return seconds, peak, removed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shards", type=int, default=300_000)
    parser.add_argument("--strays", type=int, default=1000)
    parser.add_argument("--dir", help="work directory (default: a temp dir, removed after)")
    parser.add_argument("--no-files", action="store_true", help="no file per listed path")
    args = parser.parse_args()
    work = args.dir or tempfile.mkdtemp(prefix="bench-leftovers-")
    directory = os.path.join(work, "ds")
    try:
        start = time.perf_counter()
        write_index(directory, args.shards)
        os.makedirs(os.path.join(directory, "shards"), exist_ok=True)
        if not args.no_files:
            for i in range(args.shards):
                stem = os.path.join(directory, "shards", f"in-{i // 10:07d}-{i % 10:05d}")
                open(stem + ".npy", "wb").close()
                open(stem + ".jsonl", "wb").close()
        files = len(os.listdir(os.path.join(directory, "shards")))
        print(f"{args.shards} shards, {files} files in shards/ + {args.strays} strays "
              f"(set up in {time.perf_counter() - start:.1f} s)")
        for name, load in (("DatasetIndex", load_index), ("Manifest", load_manifest)):
            seconds, peak, removed = _measure(directory, args.strays, load)
            print(f"{name:>12}: {seconds:6.2f} s  peak {peak:7.1f} MB  removed {removed}")
    finally:
        if not args.dir:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
