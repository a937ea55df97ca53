"""The shuffled read against ``np.copyto``, beside sequential and the old default order, in one run:
``python -m bench.reader --shuffled-gather [--rounds 7] [--quick]`` (or ``python -m bench.gather``; in
``make bench``).

3,000 random 256×256 images in 12 shards of 250 (590 MB, page cache warm), batches of 256, every batch
copied once more into a reused buffer (what pinning or ``.cuda()`` does with it), as ``bench.reader``.
The default order (windows of 256 shards, blocks of 1) makes every batch 256 slices from up to 250
shards, which is what the native gather (``shardio.read.gather``) is for. Rows:

- ``sequential``; ``old default w=8 b=16`` (windows of 8 shards, blocks of 16: the default before order
  version 2); ``default w=256 b=1`` as shipped (the extension when built, else numpy);
- the default order assembled three other ways, in the same run: ``numpy gather`` (the fallback without
  the extension), ``torch.cat`` (how batches were assembled before the gather), ``no read-ahead``;
- ``fresh maps``: the shards' memory maps closed before each epoch, so every slice is a first touch, as
  in a dataset with more shards than the maps a reader keeps open (``cache_shards``).

Then the assembly alone, no copy after it and no prefetch thread (``prefetch=0``), against ``np.copyto`` of
the same bytes on one thread (goal: the default >= 0.8): each way a raw batch can be copied, on 1, 2 and all
cores (``gather_threads``): ``copy, then metadata`` (one thread: the maps' copy finished before the batch's
metadata is built, where the default builds it during the copy, ``gather_started``), ``maps`` (what a dataset
whose maps all stay open copies from, after its first epoch), ``pread`` (what one with more shards than maps
kept reads: ``pread`` from the files straight into the batch), ``fresh maps`` (maps opened anew each epoch: a
page fault every few pages).

Then the first touch of a shard's pages on one thread, each way a map can be asked to have them
(``MAP_POPULATE``, ``MADV_POPULATE_READ`` a slice, ``MADV_HUGEPAGE``, ``MADV_WILLNEED``), against maps
mapped already and ``pread`` (``map_ways``: the figures ``shardio.read.gather`` chose by).

Then a cold batch: 256 random samples not in the page cache (the dataset's files dropped from it, as a
dataset larger than memory reads), gathered as page faults bring them in, after the read-ahead asked for
all of them at once (``shardio.read.gather.will_need``), or read with ``pread``.

The machine is shared: each round times ``np.copyto`` of the same bytes and then each row back to back,
and a row's figure is the median of its rounds' ratios (min-max shown). Mixing is from the epoch order
alone (``shardio.read.shuffle_quality``): distinct shards per batch, and as a share of a uniform
permutation's (exact); the assembly never changes the order.
"""

from __future__ import annotations

import argparse
import glob
import json
import mmap
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from bench.copy_baseline import BATCH, InMemoryImage, build, copy_batches, warm
from shardio import ShardDataset
from shardio.read import batches as batch_module
from shardio.read import gather as gather_module
from shardio.read.shuffle_quality import permutation_quality, runs_order, shuffle_quality

SHARDS, SAMPLES_PER_SHARD, SIDE = 12, 250, 256
ROUNDS = 7
DEFAULT = "default w=256 b=1"
TARGET = 0.5  # the default shuffled read against np.copyto
ASSEMBLY_TARGET = 0.8  # the default assembly alone against np.copyto on one thread


def _torch_cat(pieces: list[np.ndarray], out: np.ndarray, threads: int = 1) -> None:
    """How a batch was assembled before ``shardio.read.gather``: one ``torch.cat`` over the slices."""
    torch.cat([torch.from_numpy(piece) for piece in pieces], out=torch.from_numpy(out))


def _numpy_gather(pieces: list[np.ndarray], out: np.ndarray, threads: int = 1) -> None:
    gather_module._gather_numpy(pieces, out)


@contextmanager
def _assembly(gather: Callable[..., None] | None = None, read_ahead: bool = True,
              threads: int | None = None) -> Iterator[None]:
    """Batches assembled with ``gather`` (default: as shipped), with or without the read-ahead, on
    ``threads`` copy threads (default: ``gather_threads()``)."""
    saved = (batch_module.gather, batch_module.gather_started, batch_module.BatchAssembler.read_ahead,
             batch_module.gather_threads)
    if gather is not None:  # copied at once, in place of the copy begun before the metadata and waited for after

        def started(pieces: list[np.ndarray], out: np.ndarray, threads: int = 1) -> Callable[[], None]:
            gather(pieces, out, threads)
            return lambda: None

        batch_module.gather, batch_module.gather_started = gather, started
    if not read_ahead:
        batch_module.BatchAssembler.read_ahead = lambda self, pieces: None
    if threads is not None:
        batch_module.gather_threads = lambda: threads
    try:
        yield
    finally:
        (batch_module.gather, batch_module.gather_started, batch_module.BatchAssembler.read_ahead,
         batch_module.gather_threads) = saved


def _seconds(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def mixing(ds: ShardDataset) -> dict[str, float]:
    counts = ds.snapshot.counts
    source = np.repeat(np.arange(len(counts)), counts)
    measured = shuffle_quality(runs_order(ds.runs(0), counts), source, BATCH)
    return {"shards/batch": measured.sources_per_batch,
            "of permutation": measured.sources_share(permutation_quality(counts, BATCH))}


@dataclass
class Row:
    """One line of the table: the dataset's order settings and how its batches are assembled."""

    settings: dict[str, Any]
    assembly: Callable[[], Any] = _assembly
    variant: bool = False  # the default order assembled another way (indented under it)
    fresh_maps: bool = False


def rows_to_measure(threads: list[int]) -> dict[str, Row]:
    default = {"shuffle": True}  # the shipped order settings (windows of 256, blocks of 1)
    rows = {
        "sequential": Row({}),
        "old default w=8 b=16": Row({"shuffle": True, "shuffle_window": 8, "shuffle_block": 16}),
        DEFAULT: Row(default),
        "numpy gather": Row(default, lambda: _assembly(_numpy_gather), variant=True),
        "copy, then metadata": Row(default, lambda: _assembly(gather_module.gather), variant=True),
        "torch.cat (before)": Row(default, lambda: _assembly(_torch_cat), variant=True),
        "no read-ahead": Row(default, lambda: _assembly(read_ahead=False), variant=True),
        "fresh maps": Row(default, variant=True, fresh_maps=True),
    }
    for count in threads:
        rows[f"{count} gather thread(s)"] = Row(default, lambda count=count: _assembly(threads=count), variant=True)
    return rows


def measure(directory: str, rounds: int, threads: list[int]) -> dict[str, Any]:
    arrays = warm(directory)
    whole = np.concatenate(arrays)
    out = np.empty((BATCH, *whole.shape[1:]), np.uint8)
    in_memory = [{"image": InMemoryImage(whole[i : i + BATCH])} for i in range(0, len(whole), BATCH)]
    rows = rows_to_measure(threads)
    datasets = {name: ShardDataset(directory, BATCH, **row.settings) for name, row in rows.items()}

    def epoch(name: str) -> float:
        ds, row = datasets[name], rows[name]
        if row.fresh_maps:
            # The shards' maps closed, the batch buffers kept (a new dataset would first-touch new 50 MB
            # buffers too, which BatchAssembler's BufferPool exists to avoid): every slice is mapped anew.
            ds._assembler.cache.clear()
        with row.assembly():
            return _seconds(lambda: copy_batches(ds, out))

    for name in rows:
        epoch(name)  # untimed warm-up: maps opened, buffers made
    ratios: dict[str, list[float]] = {name: [] for name in rows}
    fastest = {name: float("inf") for name in rows}
    copies: dict[str, list[float]] = {name: [] for name in rows}
    for _ in range(rounds):
        for name in rows:
            copy = _seconds(lambda: copy_batches(in_memory, out))
            seconds = epoch(name)
            copies[name].append(copy)
            ratios[name].append(copy / seconds)
            fastest[name] = min(fastest[name], seconds)
    samples, total = len(whole), whole.nbytes
    table = {}
    for name, row in rows.items():
        table[name] = {
            "of copyto": statistics.median(ratios[name]), "min": min(ratios[name]), "max": max(ratios[name]),
            # the least disturbed pair on a shared machine: the fastest epoch over the fastest copy
            "best": min(copies[name]) / fastest[name], "samples/s": samples / fastest[name],
            "variant": row.variant, **(mixing(datasets[name]) if row.settings else {})}
    all_copies = [c for name in rows for c in copies[name]]
    return {"dataset": f"{SHARDS} shards x {SAMPLES_PER_SHARD}, {SIDE}x{SIDE}x3 ({total / 1e6:.0f} MB)",
            "batch": BATCH, "rounds": rounds, "torch_threads": torch.get_num_threads(),
            "gather_threads": batch_module.gather_threads(), "native_gather": gather_module.native(),
            "copyto_GB/s": total / statistics.median(all_copies) / 1e9, "rows": table,
            "target": TARGET, "default_meets_target": table[DEFAULT]["of copyto"] >= TARGET}


def assembly_threads() -> list[int]:
    """1, 2 and all cores (those this process may use), without repeats."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return sorted({1, min(2, cores), cores})


def assembly_alone(directory: str, rounds: int) -> dict[str, Any]:
    """The default shuffled order's batches assembled with no copy after them and no prefetch thread,
    against ``np.copyto`` of the same bytes on one thread: each way (maps kept, pread, fresh maps) on 1, 2
    and all cores; median of the rounds' ratios. ``default`` names the way and threads a dataset of this
    size reads with when nothing is set (maps, ``gather_threads()``)."""
    arrays = warm(directory)
    whole = np.concatenate(arrays)
    out = np.empty((BATCH, *whole.shape[1:]), np.uint8)

    def copyto() -> None:
        for i in range(0, len(whole), BATCH):
            part = whole[i : i + BATCH]
            np.copyto(out[: len(part)], part)

    def assemble(ds: ShardDataset) -> int:
        return sum(len(batch["image"]) for batch in ds)

    rows: dict[str, tuple[ShardDataset, str]] = {}
    for threads in assembly_threads():
        ways = ["maps", "pread", "fresh maps"]
        if threads == 1:
            ways.insert(1, "copy, then metadata")
        for way in ways:
            ds = ShardDataset(directory, BATCH, shuffle=True, prefetch=0, gather_threads=threads)
            ds._assembler.reads_files = way == "pread" and gather_module.native()
            rows[f"{way}, {threads} thread(s)"] = (ds, way)
    for ds, _ in rows.values():
        assemble(ds)  # untimed: maps opened (and, for "maps", their pages mapped), buffers made
    ratios: dict[str, list[float]] = {name: [] for name in rows}
    for _ in range(rounds):
        for name, (ds, way) in rows.items():
            if way == "fresh maps":
                ds._assembler.cache.clear()  # every slice a first touch of a new map
            copy = _seconds(copyto)
            # "copy, then metadata": the maps' copy done before the batch's metadata is built, not during it
            with _assembly(gather_module.gather) if way == "copy, then metadata" else _assembly():
                ratios[name].append(copy / _seconds(lambda ds=ds: assemble(ds)))
    default = f"maps, {batch_module.gather_threads()} thread(s)"
    table = {name: {"of copyto": statistics.median(values), "min": min(values), "max": max(values)}
             for name, values in ratios.items()}
    return {"rows": table, "default": default if default in table else None, "target": ASSEMBLY_TARGET,
            "default_meets_target": default in table and table[default]["of copyto"] >= ASSEMBLY_TARGET,
            "native_gather": gather_module.native()}


MADV_POPULATE_READ, MAP_POPULATE = 22, 0x8000  # Linux's values (Python's mmap module names neither here)


def map_ways(directory: str, rounds: int) -> dict[str, Any]:
    """The first touch of a shard's pages, the ways a map can be asked to have them, on one thread: the
    default order's batches of single-sample slices from maps made anew each epoch (a page fault every few
    pages), made with ``MAP_POPULATE``, with ``MADV_POPULATE_READ`` on each slice before its copy, with
    ``MADV_HUGEPAGE`` or ``MADV_WILLNEED`` on the whole map, against maps whose pages are mapped already and
    ``pread`` into the batch; each against ``np.copyto`` of the same bytes, medians of the rounds' ratios.
    Linux only, with the extension."""
    if not gather_module.native() or not hasattr(mmap, "MADV_WILLNEED"):
        return {}
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    paths = sorted(glob.glob(os.path.join(directory, "shards", "*.npy")))
    row = SIDE * SIDE * 3
    arrays = warm(directory)
    whole = np.concatenate(arrays)
    out = np.empty((BATCH, SIDE, SIDE, 3), np.uint8)
    rng = np.random.default_rng(0)
    order = [(int(s), int(i)) for s, i in zip(rng.integers(0, len(paths), len(whole)),
                                              rng.integers(0, SAMPLES_PER_SHARD, len(whole)))]
    batches = [order[i : i + BATCH] for i in range(0, len(order) - BATCH + 1, BATCH)]
    files = [gather_module.ShardFile(path, 128, row) for path in paths]

    def maps(flags: int = mmap.MAP_PRIVATE, advice: int | None = None) -> list[np.ndarray]:
        made = []
        for path in paths:
            with open(path, "rb") as f:
                mapped = mmap.mmap(f.fileno(), 0, flags=flags, prot=mmap.PROT_READ)
            if advice is not None:
                mapped.madvise(advice)
            made.append(np.frombuffer(mapped, np.uint8, offset=128).reshape(-1, SIDE, SIDE, 3))
        return made

    def from_maps(made: list[np.ndarray], populate: bool = False) -> None:
        for batch in batches:
            pieces = [made[s][i : i + 1] for s, i in batch]
            if populate:
                for piece in pieces:
                    at = piece.ctypes.data
                    libc.madvise(ctypes.c_void_p(at & ~4095), row + (at & 4095), MADV_POPULATE_READ)
            gather_module.gather(pieces, out, 1)

    def by_pread() -> None:
        for batch in batches:
            gather_module.read([(files[s], i, i + 1) for s, i in batch], out, 1)

    def copyto() -> None:
        for number in range(len(batches)):
            np.copyto(out, whole[number * BATCH : (number + 1) * BATCH])

    mapped_already = maps()
    from_maps(mapped_already)
    ways: dict[str, Callable[[], None]] = {
        "maps mapped already": lambda: from_maps(mapped_already),
        "fresh maps": lambda: from_maps(maps()),
        "fresh maps + MAP_POPULATE": lambda: from_maps(maps(mmap.MAP_PRIVATE | MAP_POPULATE)),
        "fresh maps + MADV_POPULATE_READ a slice": lambda: from_maps(maps(), populate=True),
        "fresh maps + MADV_HUGEPAGE": lambda: from_maps(maps(advice=getattr(mmap, "MADV_HUGEPAGE", 14))),
        "fresh maps + MADV_WILLNEED": lambda: from_maps(maps(advice=mmap.MADV_WILLNEED)),
        "pread": by_pread,
    }
    ratios: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(rounds):
        for name, way in ways.items():
            copy = _seconds(copyto)
            ratios[name].append(copy / _seconds(way))
    return {name: {"of copyto": statistics.median(values), "min": min(values), "max": max(values)}
            for name, values in ratios.items()}


def cold_batches(directory: str, rounds: int) -> dict[str, Any]:
    """A batch of 256 random samples whose pages are not in memory (the dataset's files dropped from the
    page cache with ``posix_fadvise(DONTNEED)``, what a dataset larger than RAM reads), gathered as
    page faults bring it in, after ``will_need`` asked for all of it at once (what ``read_ahead`` does
    a batch ahead), or read with ``pread`` (``shardio.read.gather.read``); alternated, medians in ms, the
    batch's copy at one thread. Maps made anew each time: the page cache does not drop pages still mapped.
    Only with the extension (the fallback has no read-ahead)."""
    if not gather_module.native() or not hasattr(os, "posix_fadvise"):
        return {}
    paths = sorted(glob.glob(os.path.join(directory, "shards", "*.npy")))
    shape = (SAMPLES_PER_SHARD, SIDE, SIDE, 3)
    out = np.empty((BATCH, SIDE, SIDE, 3), np.uint8)
    rng = np.random.default_rng(0)
    times: dict[str, list[float]] = {"page faults": [], "read-ahead first": [], "pread": []}
    files = [gather_module.ShardFile(path, 128, SIDE * SIDE * 3) for path in paths]
    for number in range(3 * rounds):
        for path in paths:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        maps = [np.asarray(np.memmap(p, np.uint8, mode="c", offset=128, shape=shape)) for p in paths]
        chosen = [(int(shard), int(i)) for shard, i in
                  zip(rng.integers(0, len(maps), BATCH), rng.integers(0, SAMPLES_PER_SHARD, BATCH))]
        pieces = [maps[shard][i : i + 1] for shard, i in chosen]
        way = list(times)[number % 3]
        start = time.perf_counter()
        if way == "pread":
            gather_module.read([(files[shard], i, i + 1) for shard, i in chosen], out)
        else:
            if way == "read-ahead first":
                gather_module.will_need(pieces)
            gather_module.gather(pieces, out)
        times[way].append(time.perf_counter() - start)
        del maps, pieces
    return {name: 1000 * statistics.median(values) for name, values in times.items()}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", nargs="?", help="dataset dir to create/reuse (default: a temp dir)")
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--quick", action="store_true", help="2 rounds")
    parser.add_argument("--threads", default="",
                        help="also the default order on these numbers of copy threads, e.g. 1,2,4,8")
    args = parser.parse_args(argv)
    threads = [int(t) for t in args.threads.split(",") if t]
    with tempfile.TemporaryDirectory(prefix="shardio-bench-gather-") as tmp:
        directory = build(args.directory or tmp, SHARDS, SAMPLES_PER_SHARD, SIDE)
        result = measure(directory, 2 if args.quick else args.rounds, threads)
        result["assembly"] = assembly_alone(directory, 2 if args.quick else args.rounds)
        result["map_ways"] = map_ways(directory, 2 if args.quick else args.rounds)
        result["cold_batch_ms"] = cold_batches(directory, 2 if args.quick else args.rounds)
    _print(result)
    return result


def _print(result: dict[str, Any]) -> None:
    print(f"\nshuffled read, {result['dataset']}, batches of {result['batch']}, medians of {result['rounds']} "
          f"rounds; np.copyto {result['copyto_GB/s']:.1f} GB/s; gather: "
          f"{'native' if result['native_gather'] else 'numpy (extension not built)'}, "
          f"{result['gather_threads']} thread(s) of torch's {result['torch_threads']}")
    columns = ["of copyto", "min", "max", "best", "samples/s", "shards/batch", "of permutation"]
    print(f"{'':24}" + "".join(f"{c:>15}" for c in columns))
    for name, figures in result["rows"].items():
        indent = "  " if figures["variant"] else ""
        cells = [f"{figures[c]:15.2f}" if c in figures else f"{'':15}" for c in columns]
        print(f"{indent + name:24}" + "".join(cells))
    assembly = result.get("assembly")
    if assembly:
        print(f"\nthe assembly alone (no prefetch thread, no copy after it) / np.copyto on one thread; default "
              f"{assembly['default']}:")
        print(f"{'':24}" + "".join(f"{c:>15}" for c in ("of copyto", "min", "max")))
        for name, figures in assembly["rows"].items():
            print(f"{name:24}" + "".join(f"{figures[c]:15.2f}" for c in ("of copyto", "min", "max")))
        if assembly["default"]:
            verdict = "meets" if assembly["default_meets_target"] else "MISSES"
            print(f"default assembly / np.copyto {assembly['rows'][assembly['default']]['of copyto']:.2f}: "
                  f"{verdict} the target >= {assembly['target']}")
    ways = result.get("map_ways")
    if ways:
        print("\nthe first touch of a shard's pages, one thread, / np.copyto on one thread:")
        for name, figures in ways.items():
            print(f"{name:40}" + "".join(f"{figures[c]:10.2f}" for c in ("of copyto", "min", "max")))
    cold = result.get("cold_batch_ms")
    if cold:
        print(f"a cold batch of {result['batch']} (not in the page cache): "
              f"{cold['page faults']:.0f} ms by page faults, "
              f"{cold['read-ahead first']:.0f} ms with the read-ahead first, {cold['pread']:.0f} ms by pread")
    verdict = "meets" if result["default_meets_target"] else "MISSES"
    print(f"default shuffled / np.copyto {result['rows'][DEFAULT]['of copyto']:.2f}: {verdict} the target "
          f">= {result['target']}")
    sys.stdout.flush()


if __name__ == "__main__":
    print(json.dumps(main(), indent=1))
