"""One compaction of 8 segments, the object path (``decode_segment`` -> ``merge_segments`` ->
``encode_segment``, as ``_compact`` did) against the columnar one (``merge_columns``): wall time, peak RSS
growth (each path in its own fresh process, ``ru_maxrss`` after minus before) and tracemalloc's peak (a
second fresh process each: tracing slows the object path). Both must give the same bytes.

The segments are made with numpy as ``bench.synthetic_index`` makes one: ``--shards`` rows in all,
``--per-input`` shards an input, each segment replacing a tenth of the previous one's inputs and removing
a hundredth, so the merge drops rows and keeps removals (``from_start`` False: a merge above older tiers).

``python -m bench.compaction [--shards 300000] [--per-input 10] [--segments 8]``
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
import tracemalloc

import numpy as np

from shardio.format.index import decode_segment, encode_segment, merge_segments, segment_bytes
from shardio.format.segment_merge import merge_columns
from shardio.format.segment_columns import SegmentColumns

__all__ = ["make_segments"]


def _table(strings: list[str]) -> tuple[np.ndarray, np.ndarray]:
    encoded = [s.encode() for s in strings]
    offsets = np.zeros(len(encoded) + 1, dtype="<i8")
    np.cumsum([len(e) for e in encoded], out=offsets[1:])
    return offsets, np.frombuffer(b"".join(encoded), dtype=np.uint8)


def _segment(names: list[str], version: int, per_input: int, removed: list[str], rng: np.random.Generator) -> bytes:
    names = sorted(names)
    inputs, shards = len(names), len(names) * per_input
    stems = [f"{n.rsplit('/', 1)[1].removesuffix('.tar')}-v{version}-{k:05d}" for n in names for k in range(per_input)]
    arrays = {}
    for table, values in (("input_name", names), ("input_etag", [""] * inputs),
                          ("shard_path", [f"shards/{s}.npy" for s in stems]),
                          ("shard_meta_path", [f"shards/{s}.jsonl" for s in stems]), ("removed", sorted(removed))):
        arrays[f"{table}_offsets"], arrays[f"{table}_blob"] = _table(values)
    for name in ("size", "mtime_ns", "samples", "failed"):
        arrays[f"input_{name}"] = rng.integers(0, 10**6, inputs, dtype="<i8")
    arrays["input_listed"] = np.ones(inputs, dtype=np.uint8)
    arrays["input_first_shard"] = np.arange(inputs + 1, dtype="<i8") * per_input
    for name in ("samples", "bytes", "meta_bytes"):
        arrays[f"shard_{name}"] = rng.integers(1, 10**6, shards, dtype="<i8")
    arrays["shard_algorithm"] = np.zeros(shards, dtype=np.uint8)
    arrays["shard_digest"] = rng.integers(0, 256, (shards, 16), dtype=np.uint8)
    arrays["shard_meta_digest"] = rng.integers(0, 256, (shards, 16), dtype=np.uint8)
    return segment_bytes(arrays)


def make_segments(directory: str, shards: int, per_input: int, count: int) -> list[str]:
    """``count`` segment files in ``directory`` (oldest first), ``shards`` shard rows in all."""
    rng = np.random.default_rng(0)
    per_segment = shards // per_input // count
    paths, previous, serial = [], [], 0
    for version in range(count):
        replaced = previous[::10]
        removed = previous[5::100]
        fresh = [f"s3://bucket/laion/{serial + i:09d}.tar" for i in range(per_segment - len(replaced))]
        serial += len(fresh)
        names = fresh + replaced
        path = os.path.join(directory, f"{version}.npz")
        with open(path, "wb") as f:
            f.write(_segment(names, version, per_input, removed, rng))
        paths.append(path)
        previous = names
    return paths


def _old(blobs: list[tuple[bytes, str]]) -> bytes:
    return encode_segment(merge_segments([decode_segment(data, path) for data, path in blobs], from_start=False))


def _new(blobs: list[tuple[bytes, str]]) -> bytes:
    merged = merge_columns([SegmentColumns(data, path) for data, path in blobs], from_start=False)
    assert merged is not None
    return merged.data


def _measure(way: str, paths: list[str], trace: bool) -> dict:
    blobs = [(open(p, "rb").read(), p) for p in paths]
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if trace:
        tracemalloc.start()
    start = time.perf_counter()
    data = {"old": _old, "new": _new}[way](blobs)
    seconds = time.perf_counter() - start
    out = {"seconds": seconds, "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data),
           "rss_growth_mb": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024}
    if trace:
        out["traced_peak_mb"] = tracemalloc.get_traced_memory()[1] / 2**20
    return out


def main() -> None:
    if sys.argv[1:2] == ["--measure"]:  # one measurement, in a fresh process: WAY TRACE SEGMENT...
        way, trace, *paths = sys.argv[2:]
        print(json.dumps(_measure(way, paths, trace == "1")))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shards", type=int, default=300_000)
    parser.add_argument("--per-input", type=int, default=10)
    parser.add_argument("--segments", type=int, default=8)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        paths = make_segments(directory, args.shards, args.per_input, args.segments)
        rows = sum(len(SegmentColumns(open(p, "rb").read(), p).arrays["shard_samples"]) for p in paths)
        sizes = sum(os.path.getsize(p) for p in paths)
        print(f"{len(paths)} segments, {rows} shard rows, {sizes / 2**20:.1f} MB", flush=True)
        results = {}
        for way in ("old", "new"):
            runs = [json.loads(subprocess.run(
                        [sys.executable, "-m", "bench.compaction", "--measure", way, trace, *paths],
                        check=True, capture_output=True, text=True).stdout)
                    for trace in ("0", "1")]
            results[way] = {**runs[0], "traced_peak_mb": runs[1]["traced_peak_mb"]}
            r = results[way]
            label = {"old": "objects (decode/merge/encode)", "new": "columns (merge_columns)"}[way]
            print(f"{label:31s} {r['seconds']:6.2f} s  peak RSS +{r['rss_growth_mb']:6.0f} MB  "
                  f"tracemalloc peak {r['traced_peak_mb']:6.0f} MB  -> {r['bytes'] / 2**20:.1f} MB segment", flush=True)
        same = results["old"]["sha256"] == results["new"]["sha256"]
        print(f"same bytes: {same}")
        if not same:
            sys.exit(1)


if __name__ == "__main__":
    main()
