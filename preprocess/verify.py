"""``preprocess verify DIR``: every shard's size, checksum and header against the manifest; ``--repair``
rebuilds only the inputs behind bad shards.

Checking reads every byte, with the one shard checker (``shardio.format.shard_check.shard_problems``); the
header check finds a shard whose index row lists another shape than its file holds (a bucket id edited to
another bucket of the same byte size). Repair rebuilds such a shard's input like any other's: the job
chooses each image's bucket again from the image, so it does not matter whether the index or the file was
the wrong side. Repair is
three steps, each safe to kill: drop the bad inputs from the manifest in one commit (their files are
retired, not deleted), then an ordinary ``run_job`` over just those inputs, which writes the same shard
names and bytes an original run did (over the bad files), then verify again. An input whose tar is gone
cannot be rebuilt: it is named and left as it is (its shards stay listed, bad), and the exit is non-zero.
A ``manifest.json`` that is missing or corrupt is first restored from the newest valid kept generation
(``shardio.write.directory.restore_manifest``); the shards are then checked against it as usual.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field

from preprocess.config import JobConfig
from preprocess.job import RunOptions, RunReport, run_job
from shardio.write import directory as dataset_dir
from shardio.store.root import DatasetRoot, Place, open_input, open_root
from shardio.write.directory import restore_manifest
from shardio.format import ShardEntry
from shardio.format.manifests import DatasetIndex, load_index
from shardio.format.shard_check import shard_problems

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


def _check_all(root: DatasetRoot, index: DatasetIndex, entries: Iterable[ShardEntry]) -> list[BadShard]:
    problems = shard_problems(root, index, entries, checksums=True, threads=min(8, os.cpu_count() or 1))
    return [BadShard(entry.path, entry.input, problem) for entry, problem in problems]


def verify_dataset(place: Place) -> VerifyResult:
    """Check every listed shard (size, then the checksum of both files). Needs no lock: a shard that a run
    replaced meanwhile is re-checked against the newer index, so a concurrent run is not "corruption".
    The index is read as columns and the shards checked a chunk at a time: memory holds a chunk's
    entries, not one per shard of the dataset (LAION-2B-en: 2.3M shards)."""
    root = open_root(place)
    index = load_index(root)
    result = VerifyResult(root.path, shards=len(index.shards),
                          bytes=index.totals["bytes"] + index.totals["meta_bytes"])
    bad = _check_all(root, index, index.shards)
    if bad:
        now = load_index(root)
        paths = {b.shard for b in bad}
        bad = _check_all(root, now, (entry for entry in now.shards if entry.path in paths))
    result.bad = bad
    return result


def repair_dataset(place: Place, result: VerifyResult, workers: int | None = None,
                   ray_address: str | None = None, wait_for_lock: bool = False) -> RepairResult:
    """Rebuild the inputs behind ``result.bad`` from their tars, with the dataset's own config."""
    root = open_root(place)
    repair = RepairResult()
    for path in result.bad_inputs:
        (repair.rebuilt if open_input(path).storage.is_file(path) else repair.missing).append(path)
    if repair.rebuilt:
        manifest = dataset_dir.drop_inputs(root, repair.rebuilt, wait_for_lock=wait_for_lock)
        config = JobConfig(**manifest.config)
        repair.run = run_job(RunOptions(inputs=repair.rebuilt, output=root.path, config=config, workers=workers,
                                        ray_address=ray_address, wait_for_lock=wait_for_lock))
    repair.after = verify_dataset(root)
    return repair
