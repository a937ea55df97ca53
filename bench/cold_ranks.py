"""Ranks of one node sharing a ``cache_dir`` (``bench.cold_epoch --ranks``): rank processes in lockstep, cold and
from the local copy."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import threading
from typing import Any

from bench.cold_child import child_env, command, dataset_objects, result

__all__ = ["RANK_EPOCHS", "ranks_rate", "ranks_rows"]

RANK_EPOCHS = 2  # timed, after an untimed one


def directory_bytes(directory: str) -> int:
    """Bytes of the files in ``directory`` now (a cache directory: its shards, and downloads in progress)."""
    total = 0
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return 0
    for entry in entries:
        try:
            if entry.is_file():
                total += entry.stat().st_size
        except FileNotFoundError:
            pass  # removed meanwhile
    return total


def ranks_rate(url: str, cache_dir: str, limit: int, world: int, epochs: int,
               code: str | None = None) -> dict[str, Any]:
    """``epochs`` epochs of ``world`` rank processes in lockstep (a barrier after every batch, as DDP's all-reduce
    at every step), sharing ``cache_dir`` (each its own ``limit``; none: ``url`` is a local copy), after an untimed
    one: combined samples/s from the first timed epoch's start to the last one's end, downloads summed over the
    ranks, the most the directory held (sampled every 20 ms), and the shuffle window the ranks used (the default,
    clamped to what the cache holds: ``fitting_window``)."""
    if cache_dir:
        shutil.rmtree(cache_dir, ignore_errors=True)
    folder = tempfile.mkdtemp(prefix="shardio-ranks-")
    rendezvous = os.path.join(folder, "store")  # torch.distributed's FileStore: a fresh file each time
    done, peak = threading.Event(), [0]

    def watch() -> None:
        while not done.wait(0.02):
            peak[0] = max(peak[0], directory_bytes(cache_dir))

    watcher = threading.Thread(target=watch, daemon=True)
    if cache_dir:
        watcher.start()
    try:
        procs = [subprocess.Popen(command("rank", url, epochs, cache_dir, limit, rank, world, rendezvous),
                                  env=child_env(code), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for rank in range(world)]
        results = []
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=900)
            results.append(result("rank", url, proc.returncode, stdout, stderr))
    finally:
        done.set()
        if cache_dir:
            watcher.join()
        shutil.rmtree(folder, ignore_errors=True)
        if cache_dir:
            shutil.rmtree(cache_dir, ignore_errors=True)
    seconds = max(r["ended"] for r in results) - min(r["began"] for r in results)
    samples = sum(n for r in results for n, _ in r["runs"])
    downloads = sum(r["downloads"] for r in results)
    return {"ranks": world, "epochs": epochs, "samples": samples, "seconds": round(seconds, 3),
            "samples/s": round(samples / seconds, 1), "downloads": downloads,
            "adopted": sum(r["adopted"] for r in results), "directory_peak_bytes": peak[0],
            "shuffle_window": results[0].get("shuffle_window"),
            "machine_cpu_s": round(max(r["machine_cpu_s"] for r in results), 2)}


def ranks_rows(bucket: Any, local: dict[str, str], worlds: list[int], rows: dict[str, Any], root: str,
               compare: str | None) -> dict[str, Any]:
    """For each encoding and each number of ranks: the ranks' cold epochs (a node's cache of a third of the
    dataset: each rank's ``cache_limit``, since the ranks sharing a directory hold the same files; the directory's
    peak is measured) against the same ranks reading the local copy and the raw GETs of ``rows`` (per sample: the
    same images), and the whole machine's CPU per GB against the raw GETs' (the server shares the cores). An older
    checkout (``compare``) gets a third over the ranks each: its ranks planned alone."""
    out: dict[str, Any] = {}
    for name, directory in local.items():
        url = bucket.upload_dir(directory, prefix=f"ranks-{name}")
        files, _ = dataset_objects(directory)
        nbytes, shards = sum(files.values()), len(files) // 2
        get_rate = rows[name]["raw_get_samples/s"]
        for world in worlds:
            shared = os.path.join(root, "shared-cache")
            cold = ranks_rate(url, shared, nbytes // 3, world, RANK_EPOCHS)
            local_run = ranks_rate(directory, "", 0, world, RANK_EPOCHS)
            limit = min(get_rate, local_run["samples/s"])
            row = {"ranks": world, "shards": shards, "cold": cold, "local_samples/s": local_run["samples/s"],
                   "raw_get_samples/s": get_rate, "cold / limit": round(cold["samples/s"] / limit, 3),
                   "downloads / shards, an epoch": round(cold["downloads"] / (RANK_EPOCHS * shards), 3),
                   "directory peak / limit": round(cold["directory_peak_bytes"] / (nbytes // 3), 3)}
            per_gb = cold["machine_cpu_s"] / (RANK_EPOCHS * nbytes / 1e9)
            get_per_gb = rows[name].get("machine_cpu_s_per_GB", {}).get("raw_get")
            if per_gb and get_per_gb and get_rate <= local_run["samples/s"]:
                row["machine_cpu_s_per_GB"] = round(per_gb, 2)
                row["cpu_allows / raw_get"] = round(get_per_gb / per_gb, 3)
                row["cold / what the CPU allows"] = round(row["cold / limit"] / row["cpu_allows / raw_get"], 3)
            if compare:
                before = ranks_rate(url, shared, nbytes // 3, world, RANK_EPOCHS, compare)  # the same node budget
                row["before"] = {"samples/s": before["samples/s"],
                                 "cold / limit": round(before["samples/s"] / limit, 3)}
            out[f"{name}, {world} ranks"] = row
    return out
