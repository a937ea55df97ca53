"""Comparing two dataset directories byte for byte, and checking one holds nothing half-written.

Used by the incremental, crash-safety and verify tests: "the same dataset" means the same manifest shard
list and inputs (everything but the commit time and library versions) and the same bytes in every file
under shards/, with no file the manifest does not list.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

import shardio
from shardio.format.manifests import load_manifest
from shardio.format.model_outputs import shard_files
from tests.tar_factory import decode_index

__all__ = ["dataset_state", "assert_same_dataset", "assert_clean", "decoded_indices", "assert_indices"]


def dataset_state(directory: str) -> dict[str, Any]:
    loaded = load_manifest(directory)
    manifest = loaded.to_json()  # the logical content, whatever the format version
    shards_dir = os.path.join(directory, "shards")
    files = {}
    for name in sorted(os.listdir(shards_dir)) if os.path.isdir(shards_dir) else []:
        with open(os.path.join(shards_dir, name), "rb") as f:
            files[name] = hashlib.sha256(f.read()).hexdigest()
    return {"shards": manifest["shards"], "inputs": manifest["inputs"], "samples": manifest["samples"],
            "config": manifest["config"], "files": files,
            "outputs": [o.to_json() for o in loaded.outputs],  # model outputs (spec, "Model outputs")
            "output_files": [list(e.outputs) for e in loaded.shards] if loaded.outputs else []}


def assert_same_dataset(actual: str, expected: str) -> None:
    got, want = dataset_state(actual), dataset_state(expected)
    assert [s["path"] for s in got["shards"]] == [s["path"] for s in want["shards"]], "shard list differs"
    assert got["shards"] == want["shards"], "shard sizes or checksums differ"
    assert got["inputs"] == want["inputs"], "committed inputs differ"
    assert got["files"] == want["files"], "files under shards/ differ (bytes, or an extra/missing file)"
    assert got == want


def assert_clean(directory: str, run_stopped_early: bool = False) -> None:
    """No temp file anywhere, no run's mark (spec, "Layout": the last run ended; one stopped early keeps
    its mark), and shards/ holds exactly the files the manifest lists (with each shard's model outputs)."""
    for root, _, names in os.walk(directory):
        leftovers = [n for n in names if n.startswith(".tmp-")]
        assert not leftovers, f"temp files left in {root}: {leftovers}"
    marks = [n for n in os.listdir(directory) if n.startswith(".run-")]
    assert bool(marks) == run_stopped_early, f"run marks in {directory}: {marks}"
    state = dataset_state(directory)
    names = [o["name"] for o in state["outputs"]]
    listed = {os.path.basename(p) for s in state["shards"]
              for p in shard_files(s["path"], s["meta_path"], names)}
    assert set(state["files"]) == listed, f"unlisted shard files: {set(state['files']) - listed}"


def decoded_indices(directory: str) -> list[int]:
    """Every sample's index, in dataset order, read from its pixels (checksums verified first)."""
    ds = shardio.open_dataset(directory, verify=True)
    return [decode_index(p) for i in range(len(ds.shards)) for p in ds.pixels(i)]


def assert_indices(directory: str, expected: list[int]) -> None:
    """Three separate failures, as Mosaic's resumption tests: missing, duplicated, out of order."""
    got = decoded_indices(directory)
    assert set(expected) <= set(got), f"missing samples: {sorted(set(expected) - set(got))[:10]}"
    assert len(got) == len(set(got)), "duplicated samples"
    assert set(got) <= set(expected), f"unexpected samples: {sorted(set(got) - set(expected))[:10]}"
    assert got == expected, "samples out of order"
