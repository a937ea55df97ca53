"""The epoch plan at web scale: time and memory to plan rank 0 of 64, and to open and shuffle a dataset.

Two measurements, each in a fresh child process (RSS over that process once numpy and shardio are
imported and the counts exist: the index's part is not in the figure):

- **plan**: synthetic per-shard counts (``--sizes`` shards of 1,000 samples, no files), rank 0 of 64,
  batches of 256, order version 2 with the default window and block. ``first``: the plan made and the
  first batch's pieces; ``whole``: every batch of the rank's epoch, piece by piece (up to
  ``--whole-up-to`` shards, default 300k: 2.3M shards are 140k batches and 8,985 windows, minutes). ``eager``
  is the plan before it was lazy (``epoch_runs`` + ``run_pieces``), up to ``--eager-up-to`` shards (default
  300: at 30k shards it took 29.9 s and 3.26 GB here, too much to run beside other work).
- **cached**: a remote dataset's shard cache planning a pass of one node's 8 ranks (of 64) and advancing 1,000
  steps (``--cached-sizes``): the plan is written a horizon ahead, so its time and memory stay flat.
- **dataset**: ``ShardDataset(path, 256, shuffle=True)`` opened and its first batch taken, on datasets of
  1x1-pixel samples in shards of 1,000 made with the writer (``--dataset-samples``; 1M in ~10 s, kept in
  ``bench/out/scale_plan``), with the plan's share (``plan``: ``ds.plan`` + the first batch's pieces).

    python -m bench.scale_plan                       # the make bench line (~1 minute)
    python -m bench.scale_plan --sizes 2300000 --whole-up-to 2300000 --dataset-samples ''   # LAION-2B, whole
    python -m bench.scale_plan --sizes 300,30000 --whole-up-to 30000 --dataset-samples 10000,100000
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np

SAMPLES_PER_SHARD = 1000
RANK, WORLD, BATCH = 0, 64, 256
CACHED_STEPS = 1000  # steps a cached pass advances in ``child_cached``
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out", "scale_plan")


def _memory_kb() -> tuple[int, int]:
    """(VmRSS, VmHWM) of this process in kB."""
    values = {}
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(("VmRSS:", "VmHWM:")):
                values[line[:5]] = int(line.split()[1])
    return values["VmRSS"], values["VmHWM"]


def _reset_peak() -> int:
    """Start the peak RSS over from now (Linux: ``clear_refs`` 5); returns the RSS now, in kB."""
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")
    return _memory_kb()[0]


def _over(baseline_kb: int) -> float:
    return round((_memory_kb()[1] - baseline_kb) / 1024, 1)


def child_plan(shards: int, whole: bool, eager: bool) -> dict[str, Any]:
    from shardio.read.epoch_plan import EpochPlan
    from shardio.read.order import epoch_runs, rank_batches, run_pieces

    counts = np.full(shards, SAMPLES_PER_SHARD, dtype=np.int64)
    settings = {"shuffle": True, "seed": 0, "epoch": 0, "shuffle_window": 256, "shuffle_block": 1,
                "order_version": 2}
    samples = int(counts.sum())
    baseline = _reset_peak()
    start = time.perf_counter()
    if eager:
        runs = epoch_runs(counts, **settings)
        ends = np.cumsum(runs[:, 2] - runs[:, 1])
        batches = rank_batches(samples, BATCH, RANK, WORLD, False)
        run_pieces(ends, runs, batches[0])
        return {"eager_first_s": round(time.perf_counter() - start, 3), "eager_first_mb": _over(baseline)}
    plan = EpochPlan(counts, **settings)
    batches = rank_batches(samples, BATCH, RANK, WORLD, False)
    first = plan.pieces(batches[0])
    row: dict[str, Any] = {"first_s": round(time.perf_counter() - start, 3), "first_mb": _over(baseline),
                           "batches": len(batches), "windows": plan.windows}
    if sum(b - a for _, a, b in first) != BATCH:
        raise RuntimeError(f"the first batch has {sum(b - a for _, a, b in first)} samples, not {BATCH}")
    if whole:
        read = 0
        for positions in batches:
            read += sum(b - a for _, a, b in plan.pieces(positions))
        if read != sum(len(b) for b in batches):
            raise RuntimeError(f"the rank's pieces hold {read} samples, its batches {len(batches)}")
        row.update(whole_s=round(time.perf_counter() - start, 2), whole_mb=_over(baseline),
                   whole_us_per_batch=round((time.perf_counter() - start) / len(batches) * 1e6, 1))
    return row


def child_index(path: str) -> dict[str, Any]:
    """A reader's whole start on a synthetic index: ``load_index`` (segments mapped, folded) and the epoch
    plan of rank 0 of 64 to its first batch's pieces."""
    from shardio.format.manifests import load_index
    from shardio.read.epoch_plan import EpochPlan
    from shardio.read.order import rank_batches

    baseline = _reset_peak()
    start = time.perf_counter()
    index = load_index(path)
    opened = time.perf_counter()
    open_mb = _over(baseline)
    counts = index.shards.samples
    plan = EpochPlan(counts, shuffle=True, seed=0, epoch=0, shuffle_window=256, shuffle_block=1, order_version=2)
    batches = rank_batches(int(counts.sum()), BATCH, RANK, WORLD, False)
    first = plan.pieces(batches[0])
    entry = index.shards[int(first[0][0])]  # the entry the first piece opens
    if sum(b - a for _, a, b in first) != BATCH or not entry.path.startswith("shards/"):
        raise RuntimeError(f"{path}: the first batch is not {BATCH} samples of listed shards")
    return {"shards": len(index.shards), "index_open_s": round(opened - start, 3), "index_open_mb": open_mb,
            "open_plan_s": round(time.perf_counter() - start, 3), "open_plan_mb": _over(baseline)}


def child_cached(path: str) -> dict[str, Any]:
    """A remote dataset's cache planning a pass (``shardio.read.cache``): ranks 0-7 of 64 sharing one cache directory
    (one node), the cache two windows of shards, on a synthetic index. The pass handed to the cache (``PassShards``
    over the node's steps) and the first two steps planned; then ``CACHED_STEPS`` steps advanced (no downloads:
    no threads), the horizon growing as it goes. RSS over the process once the index is open."""
    from shardio.format.manifests import load_index
    from shardio.read.cache.cache_group import CacheGroup, node_reads
    from shardio.read.cache.cache_units import ShardUnits
    from shardio.read.cache.cached_reading import PassShards
    from shardio.read.cache.shard_cache import ShardCache
    from shardio.read.epoch_plan import EpochPlan
    from shardio.read.order import rank_batches

    table = load_index(path).shards
    units = ShardUnits(path, table)
    counts = table.samples
    with tempfile.TemporaryDirectory() as cache_dir:
        cache = ShardCache(units, None, cache_dir, 2 * 256 * int(units.sizes().max()), shape=(2, 2, 3), threads=0)
        baseline = _reset_peak()
        start = time.perf_counter()
        plan = EpochPlan(counts, shuffle=True, seed=0, epoch=0, shuffle_window=256, shuffle_block=1, order_version=2)
        node, _ = node_reads(rank_batches(int(counts.sum()), BATCH, RANK, WORLD, False), CacheGroup(tuple(range(8)), 0))
        cache.plan(PassShards(node, plan, range(len(table))))
        row: dict[str, Any] = {"steps": len(node), "plan_s": round(time.perf_counter() - start, 3),
                               "plan_mb": _over(baseline)}
        steps = min(CACHED_STEPS, len(node))
        start = time.perf_counter()
        for step in range(steps):
            cache.advance(step)
        row.update(advanced=steps, ms_per_step=round((time.perf_counter() - start) / max(1, steps) * 1e3, 3),
                   mb_after=_over(baseline), entries_kept=cache._pass.end - cache._pass.base)
        cache.close()
    return row


def make_index(shards: int) -> str:
    from bench.synthetic_index import write_index

    path = os.path.join(OUT, f"index-{shards}")
    if not os.path.exists(os.path.join(path, "manifest.json")):
        write_index(path, shards)
    return path


def child_dataset(path: str) -> dict[str, Any]:
    from shardio import ShardDataset

    baseline = _reset_peak()
    start = time.perf_counter()
    ds = ShardDataset(path, BATCH, shuffle=True, prefetch=0)
    opened = time.perf_counter()
    open_mb = _over(baseline)
    batch = next(iter(ds))  # reads the metadata (.jsonl) of every shard the batch draws from
    row = {"samples": ds.samples, "open_s": round(opened - start, 3), "open_mb": open_mb,
           "open_first_s": round(time.perf_counter() - start, 3), "open_first_mb": _over(baseline)}
    if len(batch["__key__"]) != BATCH:
        raise RuntimeError(f"{path}: the first batch has {len(batch['__key__'])} samples")
    baseline = _reset_peak()
    start = time.perf_counter()
    ds.plan(1).pieces(range(0, BATCH))
    row.update(plan_s=round(time.perf_counter() - start, 4), plan_mb=_over(baseline))
    return row


def make_dataset(samples: int, per_shard: int = SAMPLES_PER_SHARD) -> str:
    """``samples`` 1x1-pixel samples in shards of ``per_shard`` from 10 inputs (made once, then reused)."""
    from shardio.format import InputEntry, Manifest
    from shardio.write.shard_writer import InputShardWriter, write_manifest

    path = os.path.join(OUT, f"ds-{samples}" + ("" if per_shard == SAMPLES_PER_SHARD else f"x{per_shard}"))
    if os.path.exists(os.path.join(path, "manifest.json")):
        return path
    manifest = Manifest(shape=(1, 1, 3), config={"height": 1, "width": 1}, versions={"shardio": "bench"})
    pixels = np.zeros((1, 1, 3), np.uint8)
    per_input = samples // 10
    index = 0
    for number in range(10):
        name = f"input-{number}.tar"
        writer = InputShardWriter(path, f"input-{number}", 1, 1, per_shard)
        for _ in range(per_input):
            writer.add(pixels, {"key": f"s{index:09d}", "tar": name, "member": f"{index}.jpg"}, name)
            index += 1
        entries = writer.close(name)
        manifest.shards.extend(entries)
        manifest.inputs[name] = InputEntry(size=per_input, mtime_ns=0, samples=per_input, failed=0,
                                           shards=[e.path for e in entries])
    write_manifest(path, manifest)
    return path


def _child(*args: str) -> dict[str, Any]:
    done = subprocess.run([sys.executable, "-m", "bench.scale_plan", "--child", *args], check=True,
                          capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="300,30000,300000,2300000", help="shard counts, comma-separated")
    parser.add_argument("--whole-up-to", type=int, default=300_000, help="iterate the whole rank up to here")
    parser.add_argument("--eager-up-to", type=int, default=300, help="plan eagerly too up to here")
    parser.add_argument("--dataset-samples", default="100000,1000000", help="ShardDataset sizes ('' none)")
    parser.add_argument("--index-sizes", default="300,30000,300000,2300000",
                        help="synthetic indexes opened and planned (shards of 1,000 samples; '' none)")
    parser.add_argument("--many-shards", default="300,30000",
                        help="ShardDatasets of that many 10-sample shards, opened + first shuffled batch ('' none)")
    parser.add_argument("--cached-sizes", default="300,30000,300000",
                        help="synthetic indexes whose remote cache plans a pass of 8 ranks of 64 ('' none)")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        kind, value, *flags = args.child
        if kind == "plan":
            row = child_plan(int(value), "whole" in flags, "eager" in flags)
        elif kind == "index":
            row = child_index(value)
        elif kind == "cached":
            row = child_cached(value)
        else:
            row = child_dataset(value)
        print(json.dumps(row))
        return row
    result: dict[str, Any] = {"plan": {}, "dataset": {}, "index": {}, "many_shards": {}, "cached": {}}
    for shards in (int(s) for s in args.sizes.split(",") if s):
        row = _child("plan", str(shards), *(["whole"] if shards <= args.whole_up_to else []))
        if shards <= args.eager_up_to:
            row.update(_child("plan", str(shards), "eager"))
        result["plan"][shards] = row
        print(f"plan  {shards:>9,} shards: {row}", flush=True)
    for samples in (int(s) for s in args.dataset_samples.split(",") if s):
        row = _child("dataset", make_dataset(samples))
        result["dataset"][samples] = row
        print(f"open  {samples:>9,} samples: {row}", flush=True)
    for shards in (int(s) for s in args.index_sizes.split(",") if s):
        row = _child("index", make_index(shards))
        result["index"][shards] = row
        print(f"index {shards:>9,} shards, load_index + plan rank {RANK}/{WORLD}: {row}", flush=True)
    for shards in (int(s) for s in args.many_shards.split(",") if s):
        row = _child("dataset", make_dataset(shards * 10, per_shard=10))
        result["many_shards"][shards] = row
        print(f"open  {shards:>9,} shards of 10 samples, ShardDataset + first shuffled batch: {row}", flush=True)
    for shards in (int(s) for s in args.cached_sizes.split(",") if s):
        row = _child("cached", make_index(shards))
        result["cached"][shards] = row
        print(f"cache {shards:>9,} shards, a pass planned for ranks 0-7 of {WORLD} (one node), the cache two "
              f"windows: {row}", flush=True)
    sizes = sorted(result["dataset"])
    if len(sizes) >= 2:
        small, big = result["dataset"][sizes[0]], result["dataset"][sizes[-1]]
        print(f"open + first shuffled batch, {sizes[-1]:,} vs {sizes[0]:,} samples: "
              f"+{big['open_first_mb'] - small['open_first_mb']:.1f} MB, "
              f"+{big['open_first_s'] - small['open_first_s']:.3f} s (plan: "
              f"+{big['plan_mb'] - small['plan_mb']:.1f} MB, +{big['plan_s'] - small['plan_s']:.4f} s)")
    return result


if __name__ == "__main__":
    main()
