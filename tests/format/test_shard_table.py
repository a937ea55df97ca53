"""The reader's view of the index (shardio/format/shard_table.py, ``load_index``): the same shards, in the
same order, as ``load_manifest`` after any sequence of commits, replacements, drops and compactions; a
corrupt or forged segment is named; a dataset above ``EAGER_CHECK_SHARDS`` opens without touching its
shards and still names a missing, truncated or corrupt one when a batch first needs it."""

from __future__ import annotations

import io
import json
import os
import pickle
import zipfile

import numpy as np
import pytest

import shardio
from shardio import ShardDataset
from shardio.errors import ShardFormatError, ShardIntegrityError
from shardio.format.index import segment_path
from shardio.format.manifests import load_index, load_manifest
from shardio.read import snapshot as snapshot_module
from tests.dataset_fixtures import make_dataset
from tests.index_steps import run_steps
from tests.legacy_format import as_legacy


@pytest.mark.parametrize("steps", [1, 9, 23, 61, 130])
def test_the_columns_fold_to_the_manifests_shards_after_any_history(tmp_path, steps):
    out = str(tmp_path / "ds")
    run_steps(out, steps)  # adds, drops, replacements; compactions along the way
    manifest, index = load_manifest(out), load_index(out)
    assert list(index.shards) == manifest.shards
    assert index.shards.samples.tolist() == [e.samples for e in manifest.shards]
    assert index.shards.column("bytes").tolist() == [e.bytes for e in manifest.shards]
    assert index.shards.column("meta_bytes").tolist() == [e.meta_bytes for e in manifest.shards]
    assert sorted(index.shards.input_names()) == sorted(manifest.inputs)
    fields = lambda e: (e.size, e.mtime_ns, e.samples, e.failed, e.etag)  # noqa: E731
    assert {k: fields(e) for k, e in index.committed_inputs().items()} == {
        k: fields(e) for k, e in manifest.inputs.items()}
    assert (index.samples, index.generation, index.shape) == (manifest.samples, manifest.generation, manifest.shape)


def test_a_kept_generation_and_a_legacy_manifest_read_as_columns_too(tmp_path):
    out = str(tmp_path / "ds")
    run_steps(out, 12)
    first = load_manifest(out, 3)
    assert list(load_index(out, 3).shards) == first.shards
    legacy = str(tmp_path / "legacy")
    make_dataset(legacy, (5, 9))
    as_legacy(legacy)
    assert json.load(open(os.path.join(legacy, "manifest.json")))["format_version"] in (1, 2)
    assert list(load_index(legacy).shards) == load_manifest(legacy).shards


def _rewrite_member(out: str, member: str, array: np.ndarray) -> None:
    """Replace one member of the first segment, renaming the segment (and the root's entry) to the new
    bytes' digest: a segment that checks out but says something malformed."""
    root_path = os.path.join(out, "manifest.json")
    root = json.load(open(root_path))
    ref = root["segments"][0]
    old = open(os.path.join(out, ref["path"]), "rb").read()
    buffer = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(old)) as src, zipfile.ZipFile(buffer, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            data = src.read(info)
            if info.filename == f"{member}.npy":
                npy = io.BytesIO()
                np.lib.format.write_array(npy, array, allow_pickle=True)
                data = npy.getvalue()
            dst.writestr(info.filename, data)
    data = buffer.getvalue()
    ref["path"], ref["bytes"] = segment_path(data), len(data)
    open(os.path.join(out, ref["path"]), "wb").write(data)
    json.dump(root, open(root_path, "w"))


def test_a_corrupt_or_malformed_segment_is_named(tmp_path):
    out = str(tmp_path / "ds")
    run_steps(out, 6)
    segment = json.load(open(os.path.join(out, "manifest.json")))["segments"][0]["path"]
    path = os.path.join(out, segment)
    data = bytearray(open(path, "rb").read())
    data[-30] ^= 0xFF
    open(path, "wb").write(bytes(data))
    with pytest.raises(ShardIntegrityError, match=rf"{segment}: {len(data)} bytes with sha256 .*corrupt or truncated"):
        load_index(out)
    data[-30] ^= 0xFF
    open(path, "wb").write(bytes(data))
    _rewrite_member(out, "shard_samples", np.array([object()], dtype=object))
    with pytest.raises(ShardFormatError, match=r"not a readable index segment .*dtype object"):
        load_index(out)


def test_a_forged_shard_path_in_a_segment_is_refused_when_read(tmp_path):
    out = str(tmp_path / "ds")
    run_steps(out, 1)
    names = [b"../../etc/passwd", b"shards/in-0000-v0-00001.npy", b"shards/in-0000-v0-00002.npy"]
    _rewrite_member(out, "shard_path_blob", np.frombuffer(b"".join(names), np.uint8))
    _rewrite_member(out, "shard_path_offsets", np.cumsum([0, *map(len, names)]).astype("<i8"))
    index = load_index(out)
    with pytest.raises(ShardFormatError, match=r"unsafe shard path '\.\./\.\./etc/passwd'"):
        index.shards[0]
    # Offsets outside the blob: found at load (the check that no file is listed twice reads every path's).
    with pytest.raises(ShardFormatError, match=r"string table shard_path has offsets outside"):
        _rewrite_member(out, "shard_path_offsets", np.array([0, 99, 5, 9], "<i8"))
        load_index(out).shards[1]


def test_the_table_goes_to_a_worker_by_path_and_reads_the_same(tmp_path):
    out = str(tmp_path / "ds")
    run_steps(out, 23)
    table = load_index(out).shards
    copy = pickle.loads(pickle.dumps(table))
    assert list(copy) == list(table)


@pytest.fixture
def lazy(monkeypatch):
    """Every dataset counts as web scale: nothing is checked at open."""
    monkeypatch.setattr(snapshot_module, "EAGER_CHECK_SHARDS", 0)
    monkeypatch.setattr("shardio.read.dataset.EAGER_CHECK_SHARDS", 0)


def _batches(directory: str) -> list:
    return [batch["__key__"] for batch in ShardDataset(directory, 4)]


@pytest.mark.parametrize("damage", ["missing", "truncated", "header", "meta_missing"])
def test_above_the_eager_limit_a_bad_shard_is_named_when_first_read(tmp_path, lazy, damage):
    out = str(tmp_path / "ds")
    make_dataset(out, (20,))
    path = os.path.join(out, "shards", "input-0-00001.npy")
    if damage == "missing":
        os.remove(path)
    elif damage == "truncated":
        os.truncate(path, os.path.getsize(path) - 1)
    elif damage == "header":
        with open(path, "r+b") as f:
            f.write(b"garbage!")
    else:
        os.remove(path.removesuffix(".npy") + ".jsonl")
    dataset = ShardDataset(out, 4)  # opens: nothing checked yet
    expected = {"missing": (ShardIntegrityError, r"input-0-00001\.npy: listed in the manifest but missing.*HINT"),
                "truncated": (ShardIntegrityError, r"input-0-00001\.npy: \d+ bytes, the manifest says \d+ \(truncated"),
                "header": (ShardFormatError, r"input-0-00001\.npy.*not a shardio shard"),
                "meta_missing": (ShardIntegrityError, r"input-0-00001\.jsonl: listed in the manifest but missing"),
                }[damage]
    with pytest.raises(expected[0], match=expected[1]):
        list(dataset)


def test_above_the_eager_limit_a_sound_dataset_reads_as_below_it(tmp_path, monkeypatch):
    out = str(tmp_path / "ds")
    make_dataset(out, (20, 7))
    eager = _batches(out)
    monkeypatch.setattr(snapshot_module, "EAGER_CHECK_SHARDS", 0)
    monkeypatch.setattr("shardio.read.dataset.EAGER_CHECK_SHARDS", 0)
    assert _batches(out) == eager
    assert len(shardio.open_dataset(out).shards) == 4


def test_an_unknown_checksum_algorithm_code_is_named_by_both_loaders(tmp_path):
    out = str(tmp_path / "ds")
    run_steps(out, 1)
    _rewrite_member(out, "shard_algorithm", np.array([0, 7, 0], dtype=np.uint8))
    with pytest.raises(ShardFormatError, match=r"has checksum algorithm code 7, this shardio knows 0 and 1"):
        load_manifest(out)
    with pytest.raises(ShardFormatError, match=r"shard row 1 has checksum algorithm code 7"):
        load_index(out).shards[1]
    _rewrite_member(out, "shard_algorithm", np.array([0, 0, 0], dtype=np.uint8))
    _rewrite_member(out, "shard_digest", np.zeros((3, 8), dtype=np.uint8))
    for load in (load_manifest, load_index):
        with pytest.raises(ShardFormatError, match=r"shard_digest is \(3, 8\), not \(3, 16 or 32\)"):
            load(out)


def test_committed_inputs_keep_non_ascii_names_and_etags(tmp_path):
    from shardio.format import Manifest
    from shardio.write import directory as dataset_dir
    from tests.index_steps import entries

    out = str(tmp_path / "ds")
    dataset_dir.ensure_output_dir(out)
    with dataset_dir.writing(out):
        committer = dataset_dir.Committer(out, Manifest(shape=(2, 2, 3), config={"height": 2, "width": 2}, versions={}))
        for name, etag in (("s3://b/café-1.tar", '"e1"'), ("s3://b/plain.tar", ""), ("s3://b/日本.tar", '"e3"')):
            committer.add_input(name, 7, 9, entries(name), etag=etag)
        committer.maybe_commit(force=True)
    found = load_index(out).committed_inputs()
    assert {k: (e.size, e.mtime_ns, e.etag) for k, e in found.items()} == {
        "s3://b/café-1.tar": (7, 9, '"e1"'), "s3://b/plain.tar": (7, 9, ""), "s3://b/日本.tar": (7, 9, '"e3"')}
