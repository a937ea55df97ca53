"""Every epoch cold: the reader streaming a dataset from S3, Google Cloud Storage and Azure Blob (the test
suite's emulators on loopback: SeaweedFS, fake-gcs-server, Azurite) against its two limits, in one run.

    python -m bench.cold_epoch [--clouds s3,gcs,azure] [--samples 3072] [--per-shard 64] [--ranks 4] [--quick]

The same photo-like 256x256 images as a raw and as a JPEG dataset (``bench.gpu_data``; shards of
``--per-shard``), for each cloud and each encoding:

- ``local``: ``ShardDataset`` over the local copy, shuffled (default window and block), batches of 256 copied
  once into a reused buffer (a JPEG batch decoded on the CPU), page cache warm: the local-disk limit;
- ``raw_get``: every object of the dataset (shards and their metadata) fetched with parallel GETs into memory
  (obstore, 8 threads; whole objects and 8 MB ranges, the faster counts), before and after the epochs, the
  mean: the network's limit;
- ``cold``: ``ShardDataset(URL, cache_dir=..., cache_limit=a third of the dataset)``, shuffled, the same
  batches: the cache holds a third of the shards, so every epoch downloads every shard again; two epochs on
  one dataset object, the rate over both;
- ``cold / raw_get``, ``cold / local`` and ``cold / min(raw_get, local)`` (the goal: >= 0.9).

``--ranks N`` (S3 only): N processes of one node, ranks of one world, each with its own cache (a third of the
dataset) in one shared ``cache_dir``; one cold epoch together; the combined rate, and the downloads summed
over the ranks against the number of shards (each shard is fetched once).

Writes ``bench/out/cold_epoch.json`` and prints a table. On a shared 2-core VM the server and the reader share
the cores, and the absolute rates drift: the ratios, taken in one run, are the figures.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from bench.gpu_data import build
from shardio.format.manifests import load_manifest

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "out")
BATCH = 256
GET_THREADS = 8
RANGE_BYTES = 8 << 20
GOAL = 0.9


def _log(message: str) -> None:
    print(f"[cold-epoch {time.strftime('%H:%M:%S')}] {message}", flush=True)


def _epoch(dataset: Any, out: np.ndarray) -> tuple[int, float]:
    started = time.perf_counter()
    samples = 0
    for batch in dataset:
        image = batch["image"].numpy()
        np.copyto(out[: len(image)], image)
        samples += len(image)
    return samples, time.perf_counter() - started


def _rate(runs: list[tuple[int, float]]) -> float:
    return sum(n for n, _ in runs) / sum(s for _, s in runs)


def local_rate(directory: str, epochs: int) -> float:
    from shardio import ShardDataset

    out = np.empty((BATCH, 256, 256, 3), np.uint8)
    dataset = ShardDataset(directory, BATCH, shuffle=True)
    _epoch(dataset, out)  # page cache, maps, decoder threads
    return statistics.median(n / s for n, s in (_epoch(dataset, out) for _ in range(epochs)))


def dataset_objects(directory: str) -> tuple[dict[str, int], int]:
    """({shard and metadata path relative to the dataset: bytes}, samples)."""
    manifest = load_manifest(directory)
    objects = {}
    for entry in manifest.shards:
        objects[entry.path] = entry.bytes
        objects[entry.meta_path] = entry.meta_bytes
    return objects, manifest.samples


def raw_get(url: str, objects: dict[str, int], rounds: int) -> float:
    """Best bytes/s of parallel GETs of every object (whole, or 8 MB ranges), into memory."""
    import obstore

    from shardio.store.backends import for_path

    storage = for_path(url)
    targets = {rel: storage._target(storage.join(url, rel)) for rel in objects}  # (obstore store, key)

    def whole(rel: str) -> int:
        store, key = targets[rel]
        return len(obstore.get(store, key).bytes())

    def ranged(piece: tuple[str, int, int]) -> int:
        store, key = targets[piece[0]]
        return len(obstore.get_range(store, key, start=piece[1], length=piece[2]))

    ranges = [(rel, start, min(RANGE_BYTES, size - start))
              for rel, size in objects.items() for start in range(0, size, RANGE_BYTES) if size]
    best = 0.0
    for _ in range(rounds):
        for fn, items in ((whole, list(objects)), (ranged, ranges)):
            started = time.perf_counter()
            with ThreadPoolExecutor(GET_THREADS) as pool:
                nbytes = sum(pool.map(fn, items))
            best = max(best, nbytes / (time.perf_counter() - started))
    return best


def cold_rate(url: str, cache_dir: str, limit: int, epochs: int) -> dict[str, Any]:
    from shardio import ShardDataset

    shutil.rmtree(cache_dir, ignore_errors=True)
    out = np.empty((BATCH, 256, 256, 3), np.uint8)
    dataset = ShardDataset(url, BATCH, shuffle=True, cache_dir=cache_dir, cache_limit=limit)
    runs = [_epoch(dataset, out) for _ in range(epochs)]
    stats = dataset.cache_stats()
    del dataset
    shutil.rmtree(cache_dir, ignore_errors=True)
    return {"samples/s": round(_rate(runs), 1), "epochs_samples/s": [round(n / s, 1) for n, s in runs],
            "downloads": stats.get("downloads"), "peak_over_limit": round(stats.get("peak_bytes", 0) / limit, 3)}


def _rank(url: str, cache_dir: str, limit: int, rank: int, world: int, start_at: float, out_path: str) -> None:
    from shardio import ShardDataset

    dataset = ShardDataset(url, BATCH, shuffle=True, rank=rank, world_size=world, cache_dir=cache_dir,
                           cache_limit=limit)
    out = np.empty((BATCH, 256, 256, 3), np.uint8)
    time.sleep(max(0.0, start_at - time.time()))  # every rank opened: start together
    began = time.time()
    samples, _ = _epoch(dataset, out)
    with open(out_path, "w") as f:
        json.dump({"samples": samples, "began": began, "ended": time.time(), "stats": dataset.cache_stats()}, f)


def ranks_rate(url: str, cache_dir: str, limit: int, world: int, scratch: str) -> dict[str, Any]:
    """One cold epoch of ``world`` rank processes sharing ``cache_dir``: combined samples/s and downloads."""
    shutil.rmtree(cache_dir, ignore_errors=True)
    context = multiprocessing.get_context("spawn")
    outs = [os.path.join(scratch, f"rank-{r}.json") for r in range(world)]
    start_at = time.time() + 15  # spawning and opening a dataset in each of N processes on 2 cores
    procs = [context.Process(target=_rank, args=(url, cache_dir, limit, r, world, start_at, outs[r]))
             for r in range(world)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(600)
    if any(proc.exitcode != 0 for proc in procs):
        return {"failed": [proc.exitcode for proc in procs]}
    results = []
    for path in outs:
        with open(path) as f:
            results.append(json.load(f))
    shutil.rmtree(cache_dir, ignore_errors=True)
    seconds = max(r["ended"] for r in results) - min(r["began"] for r in results)
    samples = sum(r["samples"] for r in results)
    return {"ranks": world, "samples": samples, "seconds": round(seconds, 3),
            "samples/s": round(samples / seconds, 1),
            "downloads": sum(r["stats"]["downloads"] for r in results),
            "adopted": sum(r["stats"]["adopted"] for r in results)}


def _servers(clouds: list[str], root: str) -> dict[str, Any]:
    from tests.azure_server import AzureServer
    from tests.gcs_server import GCSServer
    from tests.s3_server import S3Server

    made = {"s3": S3Server, "gcs": GCSServer, "azure": AzureServer}
    return {cloud: made[cloud](os.path.join(root, cloud)) for cloud in clouds}


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from shardio.store import backends
    from tests.object_stores import CloudBucket

    root = tempfile.mkdtemp(prefix="shardio-cold-")
    _log(f"datasets: {args.samples} images, shards of {args.per_shard}")
    data = build(os.path.join(OUT, f"cold-{args.samples}x{args.per_shard}"), args.samples, distinct=256,
                 samples_per_shard=args.per_shard, workers=os.cpu_count())
    local = {"raw": data.raw, "jpeg": data.jpeg}
    objects = {name: dataset_objects(directory) for name, directory in local.items()}
    result: dict[str, Any] = {"samples": args.samples, "per_shard": args.per_shard, "cores": os.cpu_count(),
                              "local": {}, "clouds": {}}
    epochs = 1 if args.quick else 3
    for name, directory in local.items():
        result["local"][name] = {"samples/s": round(local_rate(directory, epochs), 1),
                                 "bytes": sum(objects[name][0].values())}
        _log(f"local {name}: {result['local'][name]['samples/s']:.0f} samples/s")
    servers = _servers(args.clouds.split(","), root)
    try:
        for cloud, server in servers.items():
            os.makedirs(server.root, exist_ok=True)
            server.start()
            saved = {key: os.environ.get(key) for key in server.env()}
            os.environ.update(server.env())
            backends._OPEN.clear()  # a backend made before this server's variables were set
            try:
                bucket = CloudBucket(server, server.new_bucket())
                rows: dict[str, Any] = {}
                for name, directory in local.items():
                    url = bucket.upload_dir(directory, prefix=name)
                    files, samples = objects[name]
                    nbytes = sum(files.values())
                    rounds = 1 if args.quick else 2
                    before = raw_get(url, files, rounds)
                    cold = cold_rate(url, os.path.join(root, "cache"), nbytes // 3, 1 if args.quick else 2)
                    after = raw_get(url, files, rounds)
                    get_rate = (before + after) / 2 * samples / nbytes
                    row = {"raw_get_samples/s": round(get_rate, 1), "raw_get_MB/s": round((before + after) / 2e6, 1),
                           "local_samples/s": result["local"][name]["samples/s"], "cold": cold}
                    limit = min(get_rate, row["local_samples/s"])
                    row["cold / raw_get"] = round(cold["samples/s"] / get_rate, 3)
                    row["cold / local"] = round(cold["samples/s"] / row["local_samples/s"], 3)
                    row["cold / limit"] = round(cold["samples/s"] / limit, 3)
                    if args.ranks and cloud == "s3":
                        row["ranks"] = ranks_rate(url, os.path.join(root, "shared-cache"), nbytes // 3,
                                                  args.ranks, root)
                        if "samples/s" in row["ranks"]:
                            row["ranks"]["/ limit"] = round(row["ranks"]["samples/s"] / limit, 3)
                            row["ranks"]["shards"] = len(files) // 2
                    rows[name] = row
                    _log(f"{cloud} {name}: cold {cold['samples/s']:.0f}, raw GET {get_rate:.0f}, local "
                         f"{row['local_samples/s']:.0f} samples/s: cold / limit {row['cold / limit']:.3f}")
                result["clouds"][cloud] = rows
            finally:
                server.stop(crash=True)
                for key, value in saved.items():
                    if value is None:
                        os.environ.pop(key, None)
                    else:
                        os.environ[key] = value
                backends._OPEN.clear()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return result


def table(result: dict[str, Any]) -> str:
    lines = ["| cloud | shards | cold samples/s | raw GET | local | cold / raw GET | cold / local | "
             "cold / slower limit |", "|---|---|---|---|---|---|---|---|"]
    for cloud, rows in result["clouds"].items():
        for name, row in rows.items():
            lines.append(f"| {cloud} | {name} | {row['cold']['samples/s']:.0f} | {row['raw_get_samples/s']:.0f} | "
                         f"{row['local_samples/s']:.0f} | {row['cold / raw_get']:.3f} | {row['cold / local']:.3f} | "
                         f"{row['cold / limit']:.3f} |")
            ranks = row.get("ranks")
            if ranks and "samples/s" in ranks:
                lines.append(f"| {cloud}, {ranks['ranks']} ranks | {name} | {ranks['samples/s']:.0f} | | | | | "
                             f"{ranks['/ limit']:.3f} (downloads {ranks['downloads']} of {ranks['shards']} shards) |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clouds", default="s3,gcs,azure")
    parser.add_argument("--samples", type=int, default=3072)
    parser.add_argument("--per-shard", type=int, default=64)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=os.path.join(OUT, "cold_epoch.json"))
    args = parser.parse_args(argv)
    result = measure(args)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(table(result))
    return result


if __name__ == "__main__":
    main()
