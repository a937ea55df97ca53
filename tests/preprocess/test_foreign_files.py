"""A user's files inside a dataset folder are never deleted: the leftover cleaning (after a killed run, by
``preprocess gc``) removes only what a run of the dataset writes (spec, "What a run of a dataset writes") and
names the rest. Without Ray: a killed run is its mark and its promoted, uncommitted shard files."""

from __future__ import annotations

import json
import os

import pytest
from typer.testing import CliRunner

from preprocess.cli import app
from shardio.format import is_shard_file_name
from shardio.format.manifests import load_manifest
from shardio.write import directory as dataset_dir
from tests.dataset_fixtures import make_dataset

# A user's files in shards/: none has a shard's name (STEM-NNNNN.npy / .jpg.npy / .jsonl).
USER_FILES = ("shards/my_notes.txt", "shards/00000.tar", "shards/keep-me.npy", "shards/keep-me.jsonl",
              "shards/00001.npy", "shards/x-1234.npy")
# What a killed run leaves: promoted shard files no commit lists, a staged file.
LEFTOVERS = ("shards/input-9-0123456789-00000.npy", "shards/input-9-0123456789-00000.jsonl",
             "shards/input-9-0123456789-00001.jpg.npy", "shards/.tmp-input-9-0123456789-00002.npy.ab12cd34")


def put(directory: str, paths, data: bytes = b"mine") -> None:
    os.makedirs(os.path.join(directory, "shards"), exist_ok=True)
    for rel in paths:
        with open(os.path.join(directory, rel), "wb") as f:
            f.write(data)


def files(directory: str) -> set[str]:
    return {f"shards/{name}" for name in os.listdir(os.path.join(directory, "shards"))}


def killed_run(directory: str) -> None:
    """A run killed after its tasks promoted files: its mark and its leftovers."""
    put(directory, LEFTOVERS)
    with open(os.path.join(directory, ".run-20250101T000000Z-abc123.json"), "w") as f:
        json.dump({"run": "20250101T000000Z-abc123", "started": "2025-01-01T00:00:00+00:00"}, f)


def test_the_shard_name_rule():
    for rel in LEFTOVERS[:3]:
        assert is_shard_file_name(rel.split("/")[1]), rel
    for rel in USER_FILES:
        assert not is_shard_file_name(rel.split("/")[1]), rel
    assert is_shard_file_name("läftövér-日本-00000.npy") and is_shard_file_name("demo-123456.jsonl")
    assert not is_shard_file_name(".hidden-00000.npy") and not is_shard_file_name("-00000.npy")


@pytest.mark.parametrize("committed", [True, False], ids=["after-a-commit", "killed-before-its-first-commit"])
def test_the_cleaning_after_a_killed_run_removes_its_files_and_names_the_users(tmp_path, committed):
    out = str(tmp_path / "ds")
    if committed:
        make_dataset(out, inputs=(9, 5))
    listed = files(out) if committed else set()
    put(out, USER_FILES)
    killed_run(out)
    with dataset_dir.writing(out):
        cleaned = dataset_dir.clean_after_runs(out, load_manifest(out) if committed else None)
    assert files(out) == listed | set(USER_FILES), "only the killed run's files go"
    assert cleaned.removed == len(LEFTOVERS)
    assert cleaned.foreign == sorted(USER_FILES)
    warning = dataset_dir.foreign_files_warning(out, cleaned.foreign)
    assert all(rel in warning for rel in USER_FILES) and "not deleted" in warning
    assert all(open(os.path.join(out, rel), "rb").read() == b"mine" for rel in USER_FILES)
    assert not dataset_dir.unfinished_runs(out)


def test_gc_keeps_the_users_files_and_says_which(tmp_path):
    out = str(tmp_path / "ds")
    make_dataset(out, inputs=(9, 5))
    listed = files(out)
    put(out, USER_FILES)
    killed_run(out)
    result = CliRunner().invoke(app, ["gc", out])
    assert result.exit_code == 0, result.output
    assert files(out) == listed | set(USER_FILES)
    output = " ".join(result.output.split())  # rich wraps long lines
    assert "6 file(s) in shards/ that no run of this dataset wrote" in output
    assert all(rel in output for rel in USER_FILES), result.output

    again = CliRunner().invoke(app, ["gc", out])  # no mark left: plain gc reads shards/ too
    assert again.exit_code == 0 and files(out) == listed | set(USER_FILES)
    assert "shards/my_notes.txt" in " ".join(again.output.split())
