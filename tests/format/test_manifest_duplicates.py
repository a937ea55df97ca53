"""A manifest that lists one shard file twice (a hand edit, a bad merge) is a format error: the reader refuses
to open it naming the manifest and the file, instead of yielding those samples twice; ``verify`` reports it,
and ``verify --repair`` restores the newest valid kept generation, deleting nothing."""

from __future__ import annotations

import json
import os
from dataclasses import replace

import pytest
from typer.testing import CliRunner

from preprocess.cli import app
from shardio import ShardDataset, ShardFormatError, open_dataset
from shardio.format import InputEntry
from shardio.format.index import Delta, decode_segment, encode_segment, fold, segment_path
from shardio.format.manifests import load_manifest
from shardio.tools.cli import app as shardio_app
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


# --- format 3: the index (segments and the root that names them) --------------------------------------------


def _rewrite_index(directory: str, edit) -> None:
    """Forge the current root: ``edit(deltas)`` changes the list of its segments' deltas (in place); each
    segment is written again by content name and the root's refs and totals made to agree, as a careful
    hand edit would."""
    path = os.path.join(directory, "manifest.json")
    with open(path) as f:
        root = json.load(f)
    deltas = []
    for ref in root["segments"]:
        with open(os.path.join(directory, ref["path"]), "rb") as f:
            deltas.append(decode_segment(f.read(), ref["path"]))
    edit(deltas)
    refs = []
    for delta in deltas:
        data = encode_segment(delta)
        rel = segment_path(data)
        with open(os.path.join(directory, rel), "wb") as f:
            f.write(data)
        shards = [e for _, entries, _ in delta.inputs.values() for e in entries]
        refs.append({"path": rel, "bytes": len(data), "shards": len(shards), "inputs": len(delta.inputs),
                     "removed": len(delta.removed), "samples": sum(e.samples for e in shards)})
    root["segments"] = refs
    live = [e for _, entries, _ in fold(deltas).values() for e in entries]
    root["samples"], root["shard_count"] = sum(e.samples for e in live), len(live)
    with open(path, "w") as f:
        json.dump(root, f)


def _under_two_inputs(deltas) -> None:
    """Input 1 also lists input 0's first shard, in the one segment."""
    inputs = deltas[0].inputs
    stolen = inputs["input-0.tar"][1][0]
    entry, shards, listed = inputs["input-1.tar"]
    inputs["input-1.tar"] = (entry, [*shards, replace(stolen, input="input-1.tar")], listed)


def _in_two_segments(deltas) -> None:
    """A second segment adds an input whose one shard is input 0's first."""
    stolen = deltas[0].inputs["input-0.tar"][1][0]
    extra = InputEntry(1, 0, stolen.samples, 0, [stolen.path])
    deltas.append(Delta({"extra.tar": (extra, [replace(stolen, input="extra.tar")], True)}, set()))


@pytest.mark.parametrize("edit, words", [
    (_under_two_inputs, r"shard file 'shards/input-0-00000\.npy' is listed by inputs 'input-0\.tar' and "
                        r"'input-1\.tar' \(in segment \S+/index/\w+\.npz;"),
    (_in_two_segments, r"shard file 'shards/input-0-00000\.npy' is listed by inputs 'extra\.tar' and "
                       r"'input-0\.tar' \(in segments \S+/index/\w+\.npz and \S+/index/\w+\.npz;"),
])
def test_a_format_3_index_listing_a_shard_twice_is_refused_by_the_reader_verify_and_info(dataset, edit, words):
    _rewrite_index(dataset, edit)
    manifest = os.path.join(dataset, "manifest.json")
    with pytest.raises(ShardFormatError, match=rf"{manifest}: {words}"):
        open_dataset(dataset)
    with pytest.raises(ShardFormatError, match=words):
        ShardDataset(dataset, 10)
    plain = words.split(r" \(in")[0]  # the objects' load (a commit's) names no segment
    with pytest.raises(ShardFormatError, match=rf"{manifest}: {plain}"):
        load_manifest(dataset)

    checked = runner.invoke(app, ["verify", dataset])
    assert checked.exit_code == 1, checked.output
    said = " ".join(checked.output.split())
    assert "'shards/input-0-00000.npy' is listed by inputs" in said and "manifest.json" in said, said
    assert "all match" not in said

    info = runner.invoke(shardio_app, ["info", dataset], prog_name="shardio")
    assert info.exit_code == 1, info.output
    assert "'shards/input-0-00000.npy' is listed by inputs" in " ".join(info.output.split())


def test_identical_shards_of_two_inputs_are_not_duplicates(dataset):
    """Two shard files with the same bytes (two inputs holding the same images) are two files: read both."""
    def same_digest(deltas) -> None:
        inputs = deltas[0].inputs
        first, second = inputs["input-0.tar"][1][0], inputs["input-1.tar"][1][0]
        entry, shards, listed = inputs["input-1.tar"]
        inputs["input-1.tar"] = (entry, [replace(second, checksum=first.checksum), *shards[1:]], listed)
    _rewrite_index(dataset, same_digest)
    assert sum(len(b["__key__"]) for b in ShardDataset(dataset, 10, drop_last=False)) == 138
