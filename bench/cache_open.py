"""What opening a remote snapshot's shard cache costs (``cache_for``) at web scale: seconds and MB of RSS
over the process once the index is open, on a synthetic format 3 index (``bench.synthetic_index``; no
shard files: opening reads none), each size in a fresh child process.

    python -m bench.cache_open                       # 200k shards
    python -m bench.cache_open --sizes 200000,2300000   # and LAION-2B's 2.3M (the index takes ~10 s)
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

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out", "cache_open")


class _NoStore:
    """A downloader never asked: opening the cache downloads nothing."""

    def download(self, path: str, local_path: str, algorithm: str) -> str:
        raise AssertionError("opening a cache downloads nothing")


def child(directory: str) -> dict[str, Any]:
    from shardio.format.manifests import load_index
    from shardio.read.cache.cache_setup import cache_for

    index = load_index(directory)
    shards = index.shards
    baseline = _reset_peak()
    with tempfile.TemporaryDirectory() as cache_dir:
        start = time.perf_counter()
        cache = cache_for(directory, shards, (2, 2, 3), cache_dir, "50GB", _NoStore())  # type: ignore[arg-type]
        seconds = time.perf_counter() - start
        peak = _over(baseline)
        made = len(getattr(cache, "_units", cache.units))
        cache.close()
    return {"shards": len(shards), "seconds": round(seconds, 3), "peak_mb": peak, "units_made": made}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="200000")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child)))
        return
    from bench.synthetic_index import write_index

    for size in (int(s) for s in args.sizes.split(",")):
        directory = os.path.join(OUT, str(size))
        if not os.path.exists(os.path.join(directory, "manifest.json")):
            write_index(directory, size)
        result = subprocess.run([sys.executable, "-m", "bench.cache_open", "--child", directory],
                                capture_output=True, text=True, check=True)
        print(result.stdout.strip())


if __name__ == "__main__":
    main()
