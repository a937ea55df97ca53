"""A scripted writer of index commits, for the index tests (in-process, or as a subprocess killed at random
moments): step ``i`` commits input ``in-i.tar`` (three tiny shard entries, no shard files: the index does
not read them) and, every fifth step, drops input ``i - 3`` and replaces input ``i - 1`` with new shards.
Replaying the steps over a dataset that already holds some of them converges to the same content: the
rerun of a killed run.

With ``buckets`` (``--buckets``) the dataset is a bucketed one (format version 4: ``STEP_BUCKETS``) and
shard ``k`` of an input's version ``v`` is in bucket ``(k + v) % 3``: a replaced input changes buckets.

``python -m tests.index_steps DIR STEPS [--buckets]``
"""

from __future__ import annotations

import hashlib
import os
import sys
from typing import Any

from shardio.format import ShardEntry
from shardio.format.manifests import DatasetIndex, generation_path, list_generations, load_index, read_root
from shardio.write import directory as dataset_dir

__all__ = ["entries", "run_steps", "expected_inputs", "compacted_and_collected"]


STEP_BUCKETS = [[2, 2], [1, 4], [4, 1]]


def step_config(buckets: bool) -> dict[str, Any]:
    if buckets:
        return {"height": 2, "width": 2, "mode": "bucket", "buckets": STEP_BUCKETS}
    return {"height": 2, "width": 2}


def entries(name: str, version: int = 0, count: int = 3, buckets: bool = False) -> list[ShardEntry]:
    """``count`` shard entries of input ``name``, digests derived from the name (the same every run)."""
    out = []
    for k in range(count):
        stem = f"{name.removesuffix('.tar')}-v{version}-{k:05d}"
        digest = hashlib.sha256(stem.encode()).hexdigest()
        out.append(ShardEntry(f"shards/{stem}.npy", f"shards/{stem}.jsonl", k + 1, 128 + (k + 1) * 12, digest[:32],
                              40 * (k + 1), digest[32:], name, "xxh3_128", (k + version) % 3 if buckets else 0))
    return out


def _steps(count: int) -> list[tuple[str, str, int]]:
    steps = []
    for i in range(count):
        steps.append(("add", f"in-{i:04d}.tar", 0))
        if i % 5 == 4:
            steps.append(("drop", f"in-{i - 3:04d}.tar", 0))
            steps.append(("add", f"in-{i - 1:04d}.tar", 1))
    return steps


def expected_inputs(count: int) -> dict[str, int]:
    """input name -> shard version, after ``count`` steps."""
    live: dict[str, int] = {}
    for action, name, version in _steps(count):
        if action == "add":
            live[name] = version
        else:
            live.pop(name, None)
    return live


def compacted_and_collected(directory: str) -> dict[str, Any]:
    """Commit steps until a compaction merged every segment into one, then collect every root but the
    newest and the segments only they named (what a run's end and its retention leave); returns
    generation 7's root, which names collected segments: what a reader read just before."""
    run_steps(directory, 8)
    old_root = read_root(directory, 7)
    named = {ref["path"] for ref in read_root(directory)["segments"]}
    for generation in list_generations(directory)[:-1]:
        os.remove(generation_path(directory, generation))
    for name in os.listdir(os.path.join(directory, "index")):
        if f"index/{name}" not in named:
            os.remove(os.path.join(directory, "index", name))
    assert {ref["path"] for ref in old_root["segments"]} - named, "the old root names collected segments"
    return old_root


def run_steps(directory: str, count: int, buckets: bool = False) -> DatasetIndex:
    """Commit the steps one by one (each its own commit, so compactions happen along the way)."""
    dataset_dir.ensure_output_dir(directory)
    with dataset_dir.writing(directory):
        existing, _ = dataset_dir.load_committed(directory)
        dataset_dir.clean_leftovers(directory, existing)
        committer = dataset_dir.Committer(directory, existing, run=f"steps-{count}", shape=(2, 2, 3),
                                          config=step_config(buckets), versions={})
        for action, name, version in _steps(count):
            if action == "add":
                committed = committer.index.input(name)
                if committed is not None and committed.size == 100 + version:
                    continue  # committed unchanged: skipped, as the job skips it
                shards = entries(name, version, buckets=buckets)
                committer.add_input(name, size=100 + version, mtime_ns=7, shards=shards)
            elif committer.index.input(name) is not None:
                committer.drop_input(name)
            committer.maybe_commit(force=True)
        if committer.index.generation == 0:
            committer.commit()
        committed = load_index(directory)
        dataset_dir.clean_leftovers(directory, committed)
        return committed


if __name__ == "__main__":
    run_steps(sys.argv[1], int(sys.argv[2]), buckets="--buckets" in sys.argv[3:])
