"""Scale of the index (issue 24): synthetic datasets of many tiny shards, written through the real commit
(``shardio.write.directory.Committer``) with shard entries only (no pixels: the commit and the index never
read them), at several sizes so the curve shows.

For each size N (shards, one per input, committed ``--per-commit`` inputs at a time so the dataset is
built by N / per-commit commits, compactions included):

- **append**: 10 more inputs committed once: metadata bytes written (files created or replaced outside
  ``shards/`` and ``reports/``) and wall time;
- **on disk**: metadata bytes on disk (everything outside ``shards/`` and ``reports/``, every kept
  generation's root and the segments they keep) against the current index (its root and segments),
  after the default retention has run, as at a run's end (a run's passing generations: one root per
  10-minute bucket);
- **open**: ``load_manifest`` in a fresh process: seconds and RSS over the same process before it.

``python -m bench.scale [--sizes 300,30000,300000] [--out bench/out/scale]`` prints a table and writes
``bench/out/scale/results.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

from shardio.format import Manifest
from shardio.write import directory as dataset_dir
from tests.index_steps import entries

SCAN_EXCLUDED = ("shards", "reports")


def metadata_files(directory: str) -> dict[str, tuple[int, int]]:
    """rel path -> (size, mtime_ns) of every file outside shards/ and reports/."""
    out = {}
    for root, dirs, names in os.walk(directory):
        if root == directory:
            dirs[:] = [d for d in dirs if d not in SCAN_EXCLUDED]
        for name in names:
            path = os.path.join(root, name)
            stat = os.stat(path)
            out[os.path.relpath(path, directory)] = (stat.st_size, stat.st_mtime_ns)
    return out


def build(directory: str, shards: int, per_commit: int) -> Manifest:
    shutil.rmtree(directory, ignore_errors=True)
    dataset_dir.ensure_output_dir(directory)
    manifest = Manifest(shape=(2, 2, 3), config={"height": 2, "width": 2}, versions={})
    with dataset_dir.writing(directory):
        committer = dataset_dir.Committer(directory, manifest)
        for i in range(shards):
            name = f"in-{i:07d}.tar"
            committer.add_input(name, 1, 1, entries(name, count=1))
            if (i + 1) % per_commit == 0 or i == shards - 1:
                committer.maybe_commit(force=True)
    return committer.manifest


def append(directory: str, manifest: Manifest, inputs: int = 10) -> tuple[int, float]:
    before = metadata_files(directory)
    started = time.perf_counter()
    with dataset_dir.writing(directory):
        committer = dataset_dir.Committer(directory, manifest)
        for i in range(inputs):
            name = f"new-{i:03d}.tar"
            committer.add_input(name, 1, 1, entries(name, count=1))
        committer.maybe_commit(force=True)
    wall = time.perf_counter() - started
    after = metadata_files(directory)
    written = sum(size for rel, (size, mtime) in after.items() if before.get(rel) != (size, mtime))
    return written, wall


_OPEN = """
import json, resource, sys, time
import shardio
from shardio.format.manifests import load_manifest
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()
base = rss()
t = time.perf_counter()
m = load_manifest(sys.argv[1])
print(json.dumps({"open_s": time.perf_counter() - t, "rss_mb": (rss() - base) / 1e6, "shards": len(m.shards)}))
"""


def open_cost(directory: str) -> dict:
    out = subprocess.run([sys.executable, "-c", _OPEN, directory], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def measure(directory: str, shards: int, per_commit: int) -> dict:
    started = time.perf_counter()
    manifest = build(directory, shards, per_commit)
    build_s = time.perf_counter() - started
    written, wall = append(directory, manifest)
    with dataset_dir.writing(directory):  # what a run does at its end (default retention)
        collected = dataset_dir.collect(directory, dataset_dir.load_committed(directory)[0], dataset_dir.Retention())
    files = metadata_files(directory)
    root = json.load(open(os.path.join(directory, "manifest.json")))
    index = os.path.getsize(os.path.join(directory, "manifest.json")) + sum(s["bytes"] for s in root["segments"])
    on_disk = sum(size for size, _ in files.values())
    return {"shards": shards, "commits": -(-shards // per_commit) + 1, "build_s": round(build_s, 2),
            "append_bytes": written, "append_s": round(wall, 4), "index_bytes": index, "on_disk_bytes": on_disk,
            "on_disk_ratio": round(on_disk / index, 2), "segments": len(root["segments"]),
            "kept_generations": len(collected.kept_generations), **open_cost(directory)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="300,30000,300000")
    parser.add_argument("--per-commit", type=int, default=10, help="inputs per commit while building (min)")
    parser.add_argument("--max-commits", type=int, default=3000, help="more inputs per commit above this")
    parser.add_argument("--out", default="bench/out/scale")
    args = parser.parse_args()
    rows = []
    for size in (int(s) for s in args.sizes.split(",")):
        per_commit = max(args.per_commit, -(-size // args.max_commits))
        row = measure(os.path.join(args.out, f"n{size}"), size, per_commit)
        rows.append(row)
        print(json.dumps(row), flush=True)
    small = rows[0]
    for row in rows[1:]:
        print(f"{row['shards']} vs {small['shards']} shards: append bytes x{row['append_bytes'] / small['append_bytes']:.2f}, "
              f"append wall x{row['append_s'] / small['append_s']:.2f}, on disk / index {row['on_disk_ratio']}, "
              f"open {row['open_s']:.3f} s / {row['rss_mb']:.1f} MB")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
