"""The epochs of ``bench.cold_epoch``, each in a child process: one reader's local or cold epochs, or one rank of
several; and the datasets' objects they read."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from typing import Any

from bench.machine_cpu import machine_cpu_s
from shardio.format.manifests import load_manifest

__all__ = ["cold_rate", "command", "dataset_objects", "local_rate", "result", "child_env"]


def dataset_objects(directory: str) -> tuple[dict[str, int], int]:
    """({shard and metadata path relative to the dataset: bytes}, samples)."""
    manifest = load_manifest(directory)
    objects = {}
    for entry in manifest.shards:
        objects[entry.path] = entry.bytes
        objects[entry.meta_path] = entry.meta_bytes
    return objects, manifest.samples


def _rate(runs: list[tuple[int, float]]) -> float:
    return sum(n for n, _ in runs) / sum(s for _, s in runs)


# One process's cold epochs, run as a child (``--compare`` runs the same script on another checkout's code,
# alternated with this one's): numpy and shardio only, so any checkout runs it; ``machine_cpu_s`` goes in as
# its source, since another checkout may have no ``bench.machine_cpu``.
_CHILD = inspect.getsource(machine_cpu_s) + r"""
import json, os, shutil, sys, time, warnings
import numpy as np
from shardio import ShardDataset
warnings.filterwarnings("ignore", message=".*holds two windows of")
mode, url, cache_dir, limit, epochs = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
out = np.empty((256, 256, 256, 3), np.uint8)

step = lambda: None  # after each batch

def epoch(dataset):
    began, samples = time.perf_counter(), 0
    for batch in dataset:
        image = batch["image"].numpy()
        np.copyto(out[: len(image)], image)
        samples += len(image)
        step()
    return samples, time.perf_counter() - began

if mode == "local":
    dataset = ShardDataset(url, 256, shuffle=True)
    epoch(dataset)  # page cache, maps, decoder threads
elif mode == "rank":  # rank RANK of WORLD (sharing cache_dir with the others, or of a local copy)
    import datetime
    import torch.distributed as dist
    rank, world, rendezvous = int(sys.argv[6]), int(sys.argv[7]), sys.argv[8]
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    cache = {"cache_dir": cache_dir, "cache_limit": limit} if cache_dir else {}
    dataset = ShardDataset(url, 256, shuffle=True, **cache)  # the rank from torch.distributed, as under torchrun
    step = dist.barrier  # as DDP's all-reduce at every step: the ranks go through the epoch in lockstep
    epoch(dataset)  # as the cold row's: the processes' start and the cache's first fill are no epoch's
    dist.barrier()
else:
    shutil.rmtree(cache_dir, ignore_errors=True)
    dataset = ShardDataset(url, 256, shuffle=True, cache_dir=cache_dir, cache_limit=limit)
    if mode == "cold":  # as the local row: the process's start (threads, buffers, connections, the first fill) is
        epoch(dataset)  # not an epoch's; the cache holds a third, so the epochs after download again
cached = mode == "cold" or (mode == "rank" and bool(cache_dir))
warm = dataset.cache_stats() if cached else {}

began = time.time()
cpu, machine = os.times(), machine_cpu_s()
runs = [epoch(dataset) for _ in range(epochs)]
after, machine = os.times(), machine_cpu_s() - machine
stats = dataset.cache_stats() if cached else {}
print("RESULT " + json.dumps({"runs": runs, "cpu_s": after.user - cpu.user + after.system - cpu.system,
                              "machine_cpu_s": machine, "began": began, "ended": time.time(),
                              "downloads": stats.get("downloads", 0) - warm.get("downloads", 0),
                              "adopted": stats.get("adopted", 0) - warm.get("adopted", 0),
                              "peak_bytes": stats.get("peak_bytes", 0), "shuffle_window": dataset.shuffle_window}))
if mode == "cold":
    shutil.rmtree(cache_dir, ignore_errors=True)
"""


def command(mode: str, url: str, epochs: int, cache_dir: str = "", limit: int = 0, *more: object) -> list[str]:
    # -P: the working directory is not put first on sys.path, so a --compare checkout (PYTHONPATH) is the one imported
    return [sys.executable, "-P", "-c", _CHILD, mode, url, cache_dir, str(limit), str(epochs), *map(str, more)]


def result(mode: str, url: str, returncode: int, stdout: str, stderr: str) -> dict[str, Any]:
    line = next((ln for ln in stdout.splitlines() if ln.startswith("RESULT ")), None)
    if returncode or line is None:
        raise RuntimeError(f"{mode} epochs of {url} failed: {stderr.strip()[-800:]}")
    return json.loads(line[len("RESULT "):])  # type: ignore[no-any-return]


def child_env(code: str | None) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": code or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}


def _child(mode: str, url: str, epochs: int, code: str | None, cache_dir: str = "", limit: int = 0) -> dict[str, Any]:
    done = subprocess.run(command(mode, url, epochs, cache_dir, limit), env=child_env(code), capture_output=True,
                          text=True, timeout=900)
    found = result(mode, url, done.returncode, done.stdout, done.stderr)
    found["samples/s"] = _rate(found["runs"])
    return found


def local_rate(directory: str, epochs: int) -> dict[str, Any]:
    """``epochs`` shuffled epochs of the local copy, after a warm-up one, in a child process: samples/s and the
    machine's CPU seconds over them."""
    return _child("local", directory, epochs, None)


def cold_rate(url: str, cache_dir: str, limit: int, epochs: int, code: str | None = None) -> dict[str, Any]:
    """``epochs`` cold epochs in a child process, with this checkout's shardio or ``code``'s (a directory)."""
    found = _child("cold", url, epochs, code, cache_dir, limit)
    runs = found["runs"]
    return {"samples/s": round(found["samples/s"], 1), "epochs_samples/s": [round(n / s, 1) for n, s in runs],
            "client_cpu_s": round(found["cpu_s"], 2), "machine_cpu_s": round(found["machine_cpu_s"], 2),
            "downloads": found["downloads"],
            "peak_over_limit": round(found["peak_bytes"] / limit, 3)}
