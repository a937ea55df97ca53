"""Scale of the index: synthetic datasets of many tiny shards, written through the real commit
(``shardio.write.directory.Committer``) with shard entries only (no pixels: the commit and the index never
read them), at several sizes so the curve shows.

For each size N (shards, one per input, committed ``--per-commit`` inputs at a time so the dataset is
built by N / per-commit commits, compactions included):

- **append**: 10 more inputs committed once (the median of 3 such commits): metadata bytes written
  (files created or replaced outside ``shards/`` and ``reports/``) and wall time; and, apart, the
  run's load of the index for editing, once per run (``load_committed`` and the ``Committer``: the
  committed inputs' names sorted over the mapped segments, O(inputs) in numpy, no object per shard);
- **on disk**: metadata bytes on disk (everything outside ``shards/`` and ``reports/``, every kept
  generation's root and the segments they keep) against the current index (its root and segments),
  after the default retention has run, as at a run's end (a run's passing generations: one root per
  10-minute bucket);
- **open**: ``load_index`` (a reader's open) and ``load_committed`` + ``Committer`` (a run's), each in a
  fresh process: seconds and RSS over the same process before it.

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
from shardio.write import retention
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


def build(directory: str, shards: int, per_commit: int) -> None:
    shutil.rmtree(directory, ignore_errors=True)
    dataset_dir.ensure_output_dir(directory)
    manifest = Manifest(shape=(2, 2, 3), config={"height": 2, "width": 2}, versions={})
    with dataset_dir.writing(directory):
        committer = dataset_dir.Committer(directory, manifest, run="build")
        for i in range(shards):
            name = f"in-{i:07d}.tar"
            committer.add_input(name, 1, 1, entries(name, count=1))
            if (i + 1) % per_commit == 0 or i == shards - 1:
                committer.maybe_commit(force=True)


def append(directory: str, inputs: int = 10, rounds: int = 3) -> tuple[int, float, float]:
    """Append ``inputs`` inputs in one commit, ``rounds`` times (a run's commit: the ``Committer`` is made
    once, as a run makes it): (metadata bytes the median round wrote, its wall time, the run's load of
    the index for editing, once per run: ``load_committed`` and the ``Committer``)."""
    rows = []
    with dataset_dir.writing(directory):
        started = time.perf_counter()
        committer = dataset_dir.Committer(directory, dataset_dir.load_committed(directory)[0], run="append")
        setup = time.perf_counter() - started
        for round_ in range(rounds):
            before = metadata_files(directory)
            started = time.perf_counter()
            for i in range(inputs):
                name = f"new-{round_}-{i:03d}.tar"
                committer.add_input(name, 1, 1, entries(name, count=1))
            committer.maybe_commit(force=True)
            wall = time.perf_counter() - started
            after = metadata_files(directory)
            rows.append((sum(size for rel, (size, mtime) in after.items() if before.get(rel) != (size, mtime)), wall))
    written, wall = sorted(rows, key=lambda row: row[1])[len(rows) // 2]
    return written, wall, setup


_OPEN = """
import json, resource, sys, time
import shardio
from shardio.format.manifests import load_index, load_manifest
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()
from shardio.write import directory as dataset_dir
def run_load(directory):  # what a run with work loads: the committed index, ready to edit
    return dataset_dir.Committer(directory, dataset_dir.load_committed(directory)[0]).index
load = {"manifest": load_manifest, "index": load_index, "run": run_load}[sys.argv[2]]
base = rss()
t = time.perf_counter()
m = load(sys.argv[1])
print(json.dumps({"open_s": round(time.perf_counter() - t, 4), "rss_mb": round((rss() - base) / 1e6, 1),
                  "shards": m.totals["shard_count"] if sys.argv[2] == "run" else len(m.shards)}))
"""


def open_cost(directory: str) -> dict:
    """In fresh processes: ``load_index`` (a reader's open: columns, segments mapped), the run's load
    (``load_committed`` and the ``Committer``: the same columns, ready to edit) and ``load_manifest`` (an
    object per shard and input: what a run loaded before)."""
    out = {}
    for kind, prefix in (("index", ""), ("run", "run_"), ("manifest", "manifest_")):
        done = subprocess.run([sys.executable, "-c", _OPEN, directory, kind], capture_output=True, text=True,
                              check=True)
        row = json.loads(done.stdout)
        out.update({f"{prefix}open_s": row["open_s"], f"{prefix}rss_mb": row["rss_mb"]})
    return out


def measure(directory: str, shards: int, per_commit: int) -> dict:
    started = time.perf_counter()
    build(directory, shards, per_commit)
    build_s = time.perf_counter() - started
    written, wall, setup = append(directory)
    with dataset_dir.writing(directory):  # what a run does at its end (default retention)
        collected = retention.collect(directory, dataset_dir.load_committed(directory)[0], retention.Retention())
    files = metadata_files(directory)
    root = json.load(open(os.path.join(directory, "manifest.json")))
    index = os.path.getsize(os.path.join(directory, "manifest.json")) + sum(s["bytes"] for s in root["segments"])
    on_disk = sum(size for size, _ in files.values())
    return {"shards": shards, "commits": -(-shards // per_commit) + 1, "build_s": round(build_s, 2),
            "append_bytes": written, "append_s": round(wall, 4), "committer_setup_s": round(setup, 4),
            "index_bytes": index, "on_disk_bytes": on_disk,
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
        print(f"{row['shards']} vs {small['shards']} shards: append bytes "
              f"x{row['append_bytes'] / small['append_bytes']:.2f}, "
              f"append wall x{row['append_s'] / small['append_s']:.2f}, on disk / index {row['on_disk_ratio']}, "
              f"reader open {row['open_s']:.3f} s / {row['rss_mb']:.1f} MB, run's load {row['run_open_s']:.3f} s / "
              f"{row['run_rss_mb']:.1f} MB (load_manifest {row['manifest_open_s']:.3f} s / "
              f"{row['manifest_rss_mb']:.1f} MB)")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
