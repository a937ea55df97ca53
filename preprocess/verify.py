"""``preprocess verify DIR``: every shard's size and sha256 against the manifest; ``--repair`` rebuilds
only the inputs behind bad shards.

Checking reads every byte (sha256 runs at ~1-2 GB/s a core and releases the GIL, so a few threads keep
a disk busy). Repair is three steps, each safe to kill: drop the bad inputs from the manifest in one
commit (their files are retired, not deleted), then an ordinary ``run_job`` over just those inputs, which
writes the same shard names and bytes an original run did (over the bad files), then verify again. An input whose tar is gone
cannot be rebuilt: it is named and left as it is (its shards stay listed, bad), and the exit is non-zero.
A ``manifest.json`` that is missing or corrupt is first restored from the newest valid kept generation
(``restore_manifest``); the shards are then checked against it as usual.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from preprocess.config import JobConfig
from preprocess.job import RunOptions, RunReport, drop_inputs, run_job
from preprocess.output_lock import OutputLock
from shardio import storage
from shardio.commit import recover_manifest
from shardio.errors import ShardError
from shardio.format import Manifest, ShardEntry, file_sha256, list_generations, load_manifest, shard_nbytes

__all__ = ["BadShard", "VerifyResult", "RepairResult", "verify_dataset", "repair_dataset", "restore_manifest"]


@dataclass(frozen=True)
class BadShard:
    shard: str  # the .npy path relative to DIR (its .jsonl goes with it)
    input: str  # the tar it came from
    problem: str  # which file and what is wrong with it


@dataclass
class VerifyResult:
    directory: str
    shards: int = 0
    bytes: int = 0
    bad: list[BadShard] = field(default_factory=list)

    @property
    def bad_inputs(self) -> list[str]:
        return sorted({b.input for b in self.bad})


@dataclass
class RepairResult:
    rebuilt: list[str] = field(default_factory=list)  # inputs dropped and processed again
    missing: list[str] = field(default_factory=list)  # inputs whose tar is gone: cannot be rebuilt
    run: RunReport | None = None
    after: VerifyResult | None = None  # the check after the rebuild


def _check_shard(directory: str, entry: ShardEntry, shape: tuple[int, int, int]) -> str | None:
    if entry.bytes != shard_nbytes(entry.samples, shape[0], shape[1]):
        return f"{entry.path}: the manifest lists {entry.bytes} bytes for {entry.samples} samples (inconsistent)"
    for rel, size, sha in ((entry.path, entry.bytes, entry.sha256),
                           (entry.meta_path, entry.meta_bytes, entry.meta_sha256)):
        path = storage.join(directory, rel)
        try:
            actual = storage.file_size(path)
        except FileNotFoundError:
            return f"{rel}: missing"
        if actual != size:
            return f"{rel}: {actual} bytes, the manifest says {size} (truncated or overwritten)"
        if file_sha256(path) != sha:
            return f"{rel}: sha256 differs from the manifest (corrupt)"
    return None


def _check_all(directory: str, manifest: Manifest, entries: list[ShardEntry]) -> list[BadShard]:
    threads = min(8, os.cpu_count() or 1)
    with ThreadPoolExecutor(threads) as pool:
        problems = list(pool.map(lambda e: _check_shard(directory, e, manifest.shape), entries))
    return [BadShard(e.path, e.input, p) for e, p in zip(entries, problems) if p is not None]


def verify_dataset(directory: str) -> VerifyResult:
    """Check every listed shard (size, then sha256 of both files). Needs no lock: a shard that a run
    replaced meanwhile is re-checked against the newer manifest, so a concurrent run is not "corruption"."""
    directory = storage.check_local(directory)
    manifest = load_manifest(directory)
    result = VerifyResult(directory, shards=len(manifest.shards),
                          bytes=sum(e.bytes + e.meta_bytes for e in manifest.shards))
    bad = _check_all(directory, manifest, manifest.shards)
    if bad:
        now = load_manifest(directory)
        still = {e.path: e for e in now.shards}
        recheck = [still[b.shard] for b in bad if b.shard in still]
        bad = _check_all(directory, now, recheck)
    result.bad = bad
    return result


def repair_dataset(directory: str, result: VerifyResult, workers: int | None = None,
                   ray_address: str | None = None, wait_for_lock: bool = False) -> RepairResult:
    """Rebuild the inputs behind ``result.bad`` from their tars, with the dataset's own config."""
    directory = storage.check_local(directory)
    repair = RepairResult()
    for path in result.bad_inputs:
        (repair.rebuilt if storage.is_file(path) else repair.missing).append(path)
    if repair.rebuilt:
        manifest = drop_inputs(directory, repair.rebuilt, wait_for_lock=wait_for_lock)
        config = JobConfig(**manifest.config)
        repair.run = run_job(RunOptions(inputs=repair.rebuilt, output=directory, config=config, workers=workers,
                                        ray_address=ray_address, wait_for_lock=wait_for_lock))
    repair.after = verify_dataset(directory)
    return repair


def restore_manifest(directory: str, wait_for_lock: bool = False) -> Manifest | None:
    """Under the output lock: if ``manifest.json`` is missing or unusable and kept generations exist, restore
    the newest valid one (``shardio.commit.recover_manifest``) and return it; None if it was fine."""
    directory = storage.check_local(directory)
    if not list_generations(directory):
        return None  # nothing to restore from (or no dataset at all): the caller's error stands
    with OutputLock(directory, wait=wait_for_lock):
        try:
            load_manifest(directory)
            return None
        except ShardError:
            return recover_manifest(directory)
