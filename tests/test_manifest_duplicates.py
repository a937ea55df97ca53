"""A manifest that lists one shard file twice (a hand edit, a bad merge) is a format error: the reader refuses
to open it naming the manifest and the file, instead of yielding those samples twice; ``verify`` reports it,
and ``verify --repair`` restores the newest valid kept generation, deleting nothing."""

from __future__ import annotations

import json
import os

import pytest
from typer.testing import CliRunner

from preprocess.cli import app
from shardio import ShardDataset, ShardFormatError, open_dataset
from tests.dataset_fixtures import make_dataset
from tests.legacy_format import as_legacy

runner = CliRunner()


def _edit_manifest(directory: str, edit) -> None:
    as_legacy(directory)  # the one-document layout of format 1/2, which a hand edit can forge
    path = os.path.join(directory, "manifest.json")
    with open(path) as f:
        doc = json.load(f)
    edit(doc)
    with open(path, "w") as f:
        json.dump(doc, f)


def _duplicate_shard_entry(doc: dict) -> None:
    """The issue's hand edit: one entry copied, the sample count made to agree (138 + 10 = 148)."""
    doc["shards"].append(dict(doc["shards"][1]))
    doc["samples"] += doc["shards"][1]["samples"]


def _claim_by_two_inputs(doc: dict) -> None:
    stolen = doc["inputs"]["input-0.tar"]["shards"][0]
    doc["inputs"]["input-1.tar"]["shards"].append(stolen)


@pytest.fixture
def dataset(tmp_path) -> str:
    directory = str(tmp_path / "ds")
    make_dataset(directory, (128, 10), samples_per_shard=10)  # 138 samples, 13 + 1 shards
    return directory


@pytest.mark.parametrize("edit, words", [
    (_duplicate_shard_entry, r"shard file 'shards/input-0-00001\.npy' is listed twice"),
    (_claim_by_two_inputs, r"shard file 'shards/input-0-00000\.npy' is claimed by inputs 'input-0\.tar' "
                           r"and 'input-1\.tar'"),
])
def test_the_reader_refuses_a_shard_listed_twice_naming_the_manifest_and_the_file(dataset, edit, words):
    assert sum(len(b["__key__"]) for b in ShardDataset(dataset, 10, drop_last=False)) == 138
    _edit_manifest(dataset, edit)
    manifest = os.path.join(dataset, "manifest.json")
    with pytest.raises(ShardFormatError, match=rf"{manifest}: {words}"):
        open_dataset(dataset)
    with pytest.raises(ShardFormatError, match=words):
        ShardDataset(dataset, 10)


def test_verify_reports_the_duplicate_and_repair_restores_the_kept_generation(dataset):
    shard_files = sorted(os.listdir(os.path.join(dataset, "shards")))
    _edit_manifest(dataset, _duplicate_shard_entry)

    checked = runner.invoke(app, ["verify", dataset])
    assert checked.exit_code == 1, checked.output
    said = " ".join(checked.output.split())  # rich wraps long lines
    assert "'shards/input-0-00001.npy' is listed twice" in said and "manifest.json" in said
    assert "--repair" in said  # the way out: a kept generation holds the manifest as committed

    repaired = runner.invoke(app, ["verify", dataset, "--repair"])
    assert repaired.exit_code == 0, repaired.output
    assert "RESTORED manifest.json from kept generation 1" in repaired.output
    assert "all match the manifest" in repaired.output
    assert sorted(os.listdir(os.path.join(dataset, "shards"))) == shard_files, "repair deleted a shard"
    assert sum(len(b["__key__"]) for b in ShardDataset(dataset, 10, drop_last=False)) == 138


def test_a_duplicate_in_every_kept_generation_cannot_be_repaired_and_nothing_is_deleted(dataset):
    shard_files = sorted(os.listdir(os.path.join(dataset, "shards")))
    _edit_manifest(dataset, _duplicate_shard_entry)
    generation = os.path.join(dataset, "manifests", "0000000001.json")
    os.replace(os.path.join(dataset, "manifest.json"), generation)
    with open(generation) as f:
        text = f.read()
    with open(os.path.join(dataset, "manifest.json"), "w") as f:
        f.write(text)

    repaired = runner.invoke(app, ["verify", dataset, "--repair"])
    assert repaired.exit_code == 1, repaired.output
    said = " ".join(repaired.output.split())
    assert "is listed twice" in said and "no kept generation can replace it" in said
    assert sorted(os.listdir(os.path.join(dataset, "shards"))) == shard_files
