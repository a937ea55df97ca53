"""Where a cold epoch's fetch time goes: ways of bringing the same objects from a loopback SeaweedFS server
into local files, each against the raw parallel GET of the same objects into memory, in one run.

    python -m bench.fetch_paths [--objects 16x32,128x2] [--threads 8] [--rounds 3]

``--objects COUNTxMB,...``: sets of random-byte objects (the default: 16 of 32 MB, a raw shard of 160 256²
images; and 128 of 2 MB, a small JPEG shard). Rows, MB/s, medians of ``--rounds`` (alternated, so a busy
moment of a shared machine hits every row):

- ``raw_whole``: ``obstore.get(...).bytes()`` of each object, ``--threads`` at a time, into memory;
- ``raw_ranged``: 8 MB ``get_range`` requests over all objects, ``--threads`` at a time, into memory;
- ``download``: ``Storage.download``, the cache's fetch path (pieces at once, written at their offsets,
  hashed in order as they come);
- ``streamed_download``: one stream per object (8 MB chunks) written and hashed as it comes;
- ``stream_nohash``: the same stream written to the file, no checksum;
- ``stream_hash_nowrite`` / ``stream_nothing``: the same stream hashed only / only received;
- ``stream_small_pwrite``: the stream in 1 MB chunks, each ``os.pwrite`` at its offset, checked from the file;
- ``ranged_pwrite``: each object's 8 MB ranges fetched on ``--threads`` threads and ``os.pwrite`` at their
  offsets into a preallocated file, the checksum taken from the file afterwards (page cache, mmap);
- ``whole_write``: one GET per object into memory, written at once, hashed from memory.

Each row also reports the process's CPU seconds per GB (user + system): on 2 cores the server and the
client share the CPU, so the client's CPU per byte is what decides how close it comes to the raw GET.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from shardio.store.checksum import XXH3_128, file_checksum, new_hasher

RANGE_BYTES = 8 << 20


def _objects(spec: str) -> list[tuple[int, int]]:
    return [(int(count), int(mb)) for count, mb in (part.split("x") for part in spec.split(","))]


def _upload(store: Any, prefix: str, count: int, size: int) -> dict[str, tuple[int, str]]:
    import obstore

    out = {}
    for i in range(count):
        data = os.urandom(size)
        key = f"{prefix}/{i:04d}.bin"
        obstore.put(store, key, data)
        digest = new_hasher(XXH3_128)
        digest.update(data)
        out[key] = (size, digest.hexdigest())
    return out


def _rows(store: Any, storage: Any, bucket: str, objects: dict[str, tuple[int, str]], scratch: str,
          threads: int) -> dict[str, Callable[[], int]]:
    import obstore

    def in_pool(fn: Callable[[Any], int], items: list[Any]) -> int:
        with ThreadPoolExecutor(threads) as pool:
            return sum(pool.map(fn, items))

    def local(key: str) -> str:
        return os.path.join(scratch, key.replace("/", "_"))

    def check(key: str, digest: str) -> int:
        if digest != objects[key][1]:
            raise RuntimeError(f"{key}: checksum differs")
        return objects[key][0]

    keys = list(objects)
    ranges = [(key, start, min(RANGE_BYTES, size - start))
              for key, (size, _) in objects.items() for start in range(0, size, RANGE_BYTES)]

    def raw_whole() -> int:
        return in_pool(lambda key: len(obstore.get(store, key).bytes()), keys)

    def raw_ranged() -> int:
        return in_pool(lambda r: len(obstore.get_range(store, r[0], start=r[1], length=r[2])), ranges)

    def download() -> int:
        return in_pool(lambda key: check(key, storage.download(f"s3://{bucket}/{key}", local(key), XXH3_128)), keys)

    def streamed_download() -> int:  # the download before pieces: one stream, hashed as it is written
        def one(key: str) -> int:
            digest = new_hasher(XXH3_128)
            with open(local(key), "wb") as out:
                for chunk in obstore.get(store, key).stream(min_chunk_size=8 << 20):
                    out.write(chunk)
                    digest.update(chunk)
            return check(key, digest.hexdigest())
        return in_pool(one, keys)

    def stream_nohash() -> int:
        def one(key: str) -> int:
            with open(local(key), "wb") as out:
                for chunk in obstore.get(store, key).stream(min_chunk_size=8 << 20):
                    out.write(chunk)
            return objects[key][0]
        return in_pool(one, keys)

    def stream_hash_nowrite() -> int:
        def one(key: str) -> int:
            digest = new_hasher(XXH3_128)
            for chunk in obstore.get(store, key).stream(min_chunk_size=8 << 20):
                digest.update(chunk)
            return check(key, digest.hexdigest())
        return in_pool(one, keys)

    def stream_nothing() -> int:
        def one(key: str) -> int:
            n = 0
            for chunk in obstore.get(store, key).stream(min_chunk_size=8 << 20):
                n += len(chunk)
            return n
        return in_pool(one, keys)

    def stream_small_pwrite() -> int:
        def one(key: str) -> int:
            fd = os.open(local(key), os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                offset = 0
                for chunk in obstore.get(store, key).stream(min_chunk_size=1 << 20):
                    offset += os.pwrite(fd, chunk, offset)
            finally:
                os.close(fd)
            return check(key, file_checksum(local(key), XXH3_128))
        return in_pool(one, keys)

    def whole_write() -> int:
        def one(key: str) -> int:
            data = obstore.get(store, key).bytes()
            with open(local(key), "wb") as out:
                out.write(data)
            digest = new_hasher(XXH3_128)
            digest.update(data)
            return check(key, digest.hexdigest())
        return in_pool(one, keys)

    def ranged_pwrite() -> int:
        fds = {}
        for key, (size, _) in objects.items():
            fd = os.open(local(key), os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
            os.ftruncate(fd, size)
            fds[key] = fd

        def piece(r: tuple[str, int, int]) -> int:
            key, start, length = r
            data = obstore.get_range(store, key, start=start, length=length)
            os.pwrite(fds[key], memoryview(data), start)
            return length
        try:
            total = in_pool(piece, ranges)
        finally:
            for fd in fds.values():
                os.close(fd)
        for key in keys:
            check(key, file_checksum(local(key), XXH3_128))
        return total

    return {"raw_whole": raw_whole, "raw_ranged": raw_ranged, "download": download,
            "streamed_download": streamed_download, "stream_nohash": stream_nohash,
            "stream_hash_nowrite": stream_hash_nowrite, "stream_small_pwrite": stream_small_pwrite,
            "stream_nothing": stream_nothing, "ranged_pwrite": ranged_pwrite, "whole_write": whole_write}


def _pages(scratch: str, pages: str, nbytes: int) -> None:
    """Put the machine's free memory in one state before a row: ``warm``, pages the kernel just freed (a file
    of ``nbytes`` written and removed: what a cache evicting as it downloads reuses), or ``cold``, pages
    free for a few seconds (on a VM with free page reporting the host has taken them back, and the first
    touch of each costs a fault on the host)."""
    if pages == "cold":
        time.sleep(3)
        return
    ballast = os.path.join(scratch, "ballast")
    block = bytes(8 << 20)
    with open(ballast, "wb") as f:
        for _ in range(0, nbytes, len(block)):
            f.write(block)
    os.remove(ballast)


def measure(objects_spec: str, threads: int, rounds: int, pages: str) -> dict[str, Any]:
    from bench.s3_clients import obstore_store
    from shardio.store.s3 import S3Storage
    from tests.object_stores import point_environment_at, restore_environment
    from tests.s3_server import BENCH_VOLUME_MB, S3Server

    root = tempfile.mkdtemp(prefix="shardio-fetch-paths-")
    server = S3Server(os.path.join(root, "server"), volume_size_mb=BENCH_VOLUME_MB)
    server.start()
    saved = point_environment_at(server)
    result: dict[str, Any] = {"threads": threads, "rounds": rounds, "pages": pages, "cores": os.cpu_count(), "sets": {}}
    try:
        bucket = server.new_bucket()
        store = obstore_store(bucket, server.env())
        storage = S3Storage()
        for count, mb in _objects(objects_spec):
            objects = _upload(store, f"{count}x{mb}", count, mb << 20)
            scratch = os.path.join(root, "files")
            rows = _rows(store, storage, bucket, objects, scratch, threads)
            rates: dict[str, list[float]] = {name: [] for name in rows}
            cpu: dict[str, list[float]] = {name: [] for name in rows}
            for _ in range(rounds):
                for name, fn in rows.items():
                    shutil.rmtree(scratch, ignore_errors=True)
                    os.makedirs(scratch)
                    _pages(scratch, pages, sum(size for size, _ in objects.values()))
                    before, started = os.times(), time.perf_counter()
                    nbytes = fn()
                    seconds, after = time.perf_counter() - started, os.times()
                    rates[name].append(nbytes / seconds / 1e6)
                    cpu[name].append((after.user - before.user + after.system - before.system) / (nbytes / 1e9))
            raw = statistics.median(rates["raw_whole"])
            result["sets"][f"{count}x{mb}MB"] = {
                name: {"MB/s": round(statistics.median(rates[name]), 1),
                       "/ raw_whole": round(statistics.median(rates[name]) / raw, 3),
                       "client_cpu_s_per_GB": round(statistics.median(cpu[name]), 2)} for name in rows}
            shutil.rmtree(scratch, ignore_errors=True)
    finally:
        server.stop(crash=True)
        restore_environment(saved)
        shutil.rmtree(root, ignore_errors=True)
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--objects", default="16x32,128x2")
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--pages", choices=("warm", "cold"), default="warm",
                        help="free memory before each row: just freed (warm) or freed seconds ago (cold)")
    args = parser.parse_args(argv)
    result = measure(args.objects, args.threads, args.rounds, args.pages)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
