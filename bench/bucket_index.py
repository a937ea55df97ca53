"""What a bucketed index costs against a single-shape one (format version 4's ``shard_bucket`` column,
``shardio.format``, "Buckets"): per shard, the index's bytes and objects on storage, and a reader's open
(``load_index``: the segment mapped, checked and folded; the snapshot; every shard's bucket id gathered;
one shard's entry made) in time and peak RSS over the process, each run in a fresh child process.
The indexes are synthetic (``bench.synthetic_index``: one compacted segment, no shard files), the same
shards with and without 20 buckets.

    python -m bench.bucket_index [--sizes 300,30000,300000] [--buckets 20] [--repeat 3]
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

from bench.scale_plan import _over, _reset_peak


def child(directory: str) -> dict[str, Any]:
    from shardio.format.manifests import load_index
    from shardio.read.snapshot import DatasetSnapshot
    from shardio.store.root import open_root

    baseline = _reset_peak()
    start = time.perf_counter()
    root = open_root(directory)
    index = load_index(root)
    snapshot = DatasetSnapshot(root, index)
    ids = snapshot.shard_buckets
    middle = len(snapshot.shards) // 2
    entry = snapshot.shards[middle]
    shape = snapshot.shard_shape(middle)
    seconds = time.perf_counter() - start
    assert entry.bucket == int(ids[middle]) and shape == snapshot.buckets[entry.bucket]
    return {"shards": len(snapshot.shards), "seconds": seconds, "peak_mb": _over(baseline),
            "buckets": len(snapshot.buckets)}


def _storage(directory: str) -> tuple[int, int]:
    """(bytes, objects) of the index on storage: the root and its segments."""
    files = [os.path.join(directory, "manifest.json")]
    files += [os.path.join(directory, "index", name) for name in os.listdir(os.path.join(directory, "index"))]
    return sum(os.path.getsize(f) for f in files), len(files)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="300,30000,300000")
    parser.add_argument("--buckets", type=int, default=20)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child)))
        return
    from bench.synthetic_index import write_index

    rows = []
    with tempfile.TemporaryDirectory(prefix="shardio-bucket-index-") as root:
        for size in (int(s) for s in args.sizes.split(",")):
            for buckets in (0, args.buckets):
                directory = os.path.join(root, f"{size}-{buckets}")
                write_index(directory, size, buckets=buckets)
                nbytes, objects = _storage(directory)
                runs = [json.loads(subprocess.run([sys.executable, "-m", "bench.bucket_index", "--child", directory],
                                                  capture_output=True, text=True, check=True).stdout)
                        for _ in range(args.repeat)]
                seconds = sorted(r["seconds"] for r in runs)[len(runs) // 2]
                peak = sorted(r["peak_mb"] for r in runs)[len(runs) // 2]
                row = {"shards": size, "buckets": buckets or 1, "index_bytes": nbytes, "objects": objects,
                       "open_s": round(seconds, 4), "peak_mb": peak,
                       "us_per_shard": round(1e6 * seconds / size, 3),
                       "index_bytes_per_shard": round(nbytes / size, 1),
                       "rss_bytes_per_shard": round(peak * 2**20 / size, 1)}
                rows.append(row)
                print(json.dumps(row), flush=True)
    print()
    print(f"{'shards':>8} {'buckets':>7} {'objects':>7} {'index B/shard':>13} {'open µs/shard':>13} "
          f"{'open s':>8} {'peak RSS MB':>11} {'RSS B/shard':>11}")
    for r in rows:
        print(f"{r['shards']:>8} {r['buckets']:>7} {r['objects']:>7} {r['index_bytes_per_shard']:>13} "
              f"{r['us_per_shard']:>13} {r['open_s']:>8} {r['peak_mb']:>11} {r['rss_bytes_per_shard']:>11}")


if __name__ == "__main__":
    main()
