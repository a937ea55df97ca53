"""Opening one object-store dataset's index from several processes of one node, through the node's copy of
its segments (``shardio.format.segment_cache``): bytes fetched in all against the index's size, and each
process's open time. The index is synthetic (``bench.synthetic_index``: one compacted segment, no shard
files), on the tests' S3 server (SeaweedFS) on loopback.

    python -m bench.index_open [--shards 2300000] [--processes 8] [--buckets 0]

``--buckets N``: a bucketed dataset's index (format version 4: N buckets, the ``shard_bucket`` column).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

from bench.synthetic_index import write_index
from tests.object_stores import CloudBucket
from tests.s3_server import BENCH_VOLUME_MB, S3Server

# One process: open the index through the cache, report the bytes it fetched and its open time.
_OPEN = """
import json, os, sys, time
from shardio.format.manifests import load_index
from shardio.store.s3 import S3Storage
fetched = [0]
download, read_bytes = S3Storage.download, S3Storage.read_bytes
def counted_download(self, path, local_path, algorithm, *args, **kwargs):
    digest = download(self, path, local_path, algorithm, *args, **kwargs)
    fetched[0] += os.path.getsize(local_path)
    return digest
def counted_read(self, path):
    data = read_bytes(self, path)
    fetched[0] += len(data)
    return data
S3Storage.download, S3Storage.read_bytes = counted_download, counted_read
began = time.perf_counter()
index = load_index(sys.argv[1], segment_cache=sys.argv[2])
print(json.dumps({"seconds": time.perf_counter() - began, "bytes": fetched[0], "shards": len(index.shards)}))
"""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shards", type=int, default=2_300_000)
    parser.add_argument("--processes", type=int, default=8)
    parser.add_argument("--buckets", type=int, default=0)
    args = parser.parse_args(argv)
    root = tempfile.mkdtemp(prefix="shardio-index-open-")
    server = S3Server(os.path.join(root, "s3"), volume_size_mb=BENCH_VOLUME_MB)
    os.makedirs(server.root)
    server.start()
    os.environ.update(server.env())
    try:
        local = os.path.join(root, "ds")
        write_index(local, args.shards, buckets=args.buckets)
        index_dir = os.path.join(local, "index")
        index_bytes = sum(os.path.getsize(os.path.join(index_dir, n)) for n in os.listdir(index_dir))
        url = CloudBucket(server, server.new_bucket()).upload_dir(local)
        cache = os.path.join(root, "cache")
        runs = [subprocess.Popen([sys.executable, "-c", _OPEN, url, cache], stdout=subprocess.PIPE, text=True)
                for _ in range(args.processes)]
        results = [json.loads(run.communicate()[0]) for run in runs]
        later = subprocess.run([sys.executable, "-c", _OPEN, url, cache], stdout=subprocess.PIPE, text=True, check=True)
        reopen = json.loads(later.stdout)
        fetched = sum(r["bytes"] for r in results)
        print(f"index {index_bytes / 1e6:.0f} MB ({args.shards} shards); {args.processes} processes at once fetched "
              f"{fetched / 1e6:.0f} MB in all ({fetched / index_bytes:.3f} x the index's segments); "
              f"opens {min(r['seconds'] for r in results):.1f}-{max(r['seconds'] for r in results):.1f} s; "
              f"a later process: {reopen['bytes'] / 1e3:.0f} kB fetched, open {reopen['seconds']:.1f} s")
    finally:
        server.stop(crash=True)


if __name__ == "__main__":
    main()
