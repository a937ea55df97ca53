"""Format version 4 (shardio/format/spec.py, "Buckets"): a bucketed dataset written through the real writer
and commit loads with each shard at its own bucket's shape (raw and JPEG), its root and segments say
what the spec says, forged roots and segments are refused naming the file, and a single-shape dataset
is written exactly as before (version 3, no ``buckets``, no ``shard_bucket``)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from bucket_fixtures import BUCKETS, bucket_order, key_bucket, key_index, make_bucketed_dataset
from dataset_fixtures import make_dataset, pixel_indices
from shardio.errors import ShardFormatError, ShardIntegrityError
from shardio.format import BUCKET_FORMAT_VERSION, FORMAT_VERSION, READ_VERSIONS, ShardEntry
from shardio.format.index import segment_bytes, segment_path
from shardio.format.manifests import load_index, load_manifest
from shardio.read.snapshot import open_dataset
from shardio.write.shard_writer import InputShardWriter

SAMPLES = (20, 27, 13)


def root(directory: str) -> dict:
    with open(os.path.join(directory, "manifest.json")) as f:
        return json.load(f)


def write_root(directory: str, doc: dict) -> None:
    with open(os.path.join(directory, "manifest.json"), "w") as f:
        json.dump(doc, f)


def segment_arrays(directory: str, rel: str) -> dict[str, np.ndarray]:
    with np.load(os.path.join(directory, rel), allow_pickle=False) as z:
        return {name: z[name] for name in z.files}


def rewrite_segment(directory: str, mutate) -> str:
    """Replace the root's (only) segment by ``mutate(arrays)``'s, renamed by its new sha256 as a forger
    would; returns its path."""
    doc = root(directory)
    assert len(doc["segments"]) == 1
    arrays = segment_arrays(directory, doc["segments"][0]["path"])
    mutate(arrays)
    data = segment_bytes(arrays)
    rel = segment_path(data)
    with open(os.path.join(directory, rel), "wb") as f:
        f.write(data)
    doc["segments"][0].update(path=rel, bytes=len(data))
    write_root(directory, doc)
    return rel


@pytest.mark.parametrize("encoding", ["raw", "jpeg"])
def test_a_bucketed_dataset_loads_each_shard_at_its_bucket_shape(tmp_path, encoding):
    directory = make_bucketed_dataset(str(tmp_path / "ds"), BUCKETS, SAMPLES, samples_per_shard=8,
                                      encoding=encoding)
    snapshot = open_dataset(directory, verify=True)
    assert snapshot.is_bucketed and snapshot.buckets == BUCKETS
    assert snapshot.shape == (16, 16, 3)  # the budget
    assert len(snapshot) == sum(SAMPLES)
    assert snapshot.shard_buckets.dtype == np.int64 and len(snapshot.shard_buckets) == len(snapshot.shards)
    seen: list[int] = []
    per_bucket = [0] * len(BUCKETS)
    for shard in range(len(snapshot.shards)):
        bucket = int(snapshot.shard_buckets[shard])
        assert snapshot.shards[shard].bucket == bucket
        assert snapshot.shard_shape(shard) == BUCKETS[bucket]
        pixels = snapshot.pixels(shard)
        assert pixels.shape == (snapshot.shards[shard].samples, *BUCKETS[bucket], 3)
        found = pixel_indices(torch.from_numpy(np.asarray(pixels)))
        keys = snapshot.meta(shard).keys
        assert [key_bucket(k) for k in keys] == [bucket] * len(keys)  # one bucket per shard
        assert [key_index(k) for k in keys] == found.tolist()  # pixels and keys agree
        seen += found.tolist()
        per_bucket[bucket] += len(found)
    assert sorted(seen) == list(range(sum(SAMPLES)))  # every sample once
    assert per_bucket == list(SAMPLES)
    order = bucket_order(SAMPLES)
    assert [order[g] for g in range(sum(SAMPLES))].count(1) == SAMPLES[1]


def test_the_root_and_segments_of_a_bucketed_dataset(tmp_path):
    directory = make_bucketed_dataset(str(tmp_path / "ds"), BUCKETS, SAMPLES)
    doc = root(directory)
    assert doc["format_version"] == BUCKET_FORMAT_VERSION == 4 and 4 in READ_VERSIONS
    assert doc["buckets"] == [list(b) for b in BUCKETS] == doc["config"]["buckets"]
    assert list(doc)[list(doc).index("shape") + 1] == "buckets"
    arrays = segment_arrays(directory, doc["segments"][0]["path"])
    assert arrays["shard_bucket"].dtype == np.dtype("<u2")
    manifest = load_manifest(directory)
    assert arrays["shard_bucket"].tolist() == [e.bucket for e in manifest.shards]
    index = load_index(directory)
    assert index.shards.bucket_ids().tolist() == [e.bucket for e in manifest.shards]
    # Raw shard files are N x h x w x 3 .npy files numpy reads alone.
    for entry in manifest.shards:
        assert np.load(os.path.join(directory, entry.path), mmap_mode="r").shape[1:3] == BUCKETS[entry.bucket]
    # Shard numbers run across the input's buckets: one name per shard, numbered 0.. in each input.
    for name in ("input-0", "input-1"):
        numbers = sorted(int(e.path.rsplit("-", 1)[1].split(".")[0]) for e in manifest.shards if name in e.path)
        assert numbers == list(range(len(numbers)))


def test_a_single_shape_dataset_is_written_as_before(tmp_path):
    """No ``buckets`` key, version 3, no ``shard_bucket`` member: older readers read it as they did."""
    directory = str(tmp_path / "ds")
    make_dataset(directory, (9, 7), samples_per_shard=4)
    doc = root(directory)
    assert doc["format_version"] == FORMAT_VERSION == 3 and "buckets" not in doc
    assert list(doc)[:6] == ["format", "format_version", "layout", "dtype", "shape", "samples"]
    assert "shard_bucket" not in segment_arrays(directory, doc["segments"][0]["path"])
    snapshot = open_dataset(directory)
    assert not snapshot.is_bucketed and snapshot.buckets == ((8, 8),)
    assert snapshot.shard_buckets.tolist() == [0] * len(snapshot.shards)
    assert snapshot.shard_shape(1) == (8, 8)


def test_a_truncated_shard_is_caught_at_its_own_bucket_size(tmp_path):
    directory = make_bucketed_dataset(str(tmp_path / "ds"), BUCKETS, SAMPLES)
    manifest = load_manifest(directory)
    entry = next(e for e in manifest.shards if e.bucket == 2)
    assert entry.bytes == 128 + entry.samples * 12 * 20 * 3
    path = os.path.join(directory, entry.path)
    with open(path, "r+b") as f:
        f.truncate(entry.bytes - 1)
    with pytest.raises(ShardIntegrityError, match=rf"{entry.path}: {entry.bytes - 1} bytes, the manifest says"):
        open_dataset(directory)


def test_a_shard_whose_header_says_another_bucket_is_refused(tmp_path):
    directory = make_bucketed_dataset(str(tmp_path / "ds"), ((8, 12), (12, 8)), (8, 8), inputs=1)
    manifest = load_manifest(directory)
    entry = next(e for e in manifest.shards if e.bucket == 0)
    path = os.path.join(directory, entry.path)
    with open(path, "r+b") as f:  # same size (8x12 = 12x8), the other bucket's shape in the header
        header = f.read(128).replace(b"(8, 8, 12, 3)", b"(8, 12, 8, 3)")
        f.seek(0)
        f.write(header)
    snapshot = open_dataset(directory)  # sizes agree
    shard = [e.path for e in snapshot.shards].index(entry.path)
    with pytest.raises(ShardIntegrityError, match=r"header says \(8, 12, 8\), manifest says \(8, 8, 12\)"):
        snapshot.pixels(shard)


@pytest.mark.parametrize("forgery, message", [
    (lambda d: d.update(buckets=[[16, 0], [4, 4], [4, 4]]), r'"buckets"\[0\] is \[16, 0\], not \[h, w\]'),
    (lambda d: d.update(buckets=[[16, 1.5], [4, 4], [4, 4]]), r'"buckets"\[0\] is \[16, 1.5\]'),
    (lambda d: d.update(buckets="all"), r'"buckets" is all, not a list'),
    (lambda d: d.update(buckets=[[20, 12], [16, 16], [12, 24]]), r'"buckets" .* differ from the config'),
    (lambda d: d.pop("buckets"), r"format_version 4 without \"buckets\""),
    (lambda d: d.update(format_version=3), r'"buckets" in a format_version 3 root'),
    (lambda d: (d.pop("buckets"), d.update(format_version=3)), r"format_version 3 with config mode 'bucket'"),
])
def test_a_forged_bucketed_root_is_refused_naming_it(tmp_path, forgery, message):
    directory = make_bucketed_dataset(str(tmp_path / "ds"), BUCKETS, SAMPLES)
    doc = root(directory)
    forgery(doc)
    write_root(directory, doc)
    for load in (load_index, load_manifest):
        with pytest.raises(ShardFormatError, match=rf"manifest\.json: {message}"):
            load(directory)


def test_a_shard_bucket_out_of_range_is_refused_naming_the_segment(tmp_path):
    directory = make_bucketed_dataset(str(tmp_path / "ds"), BUCKETS, SAMPLES)

    def forge(arrays):
        arrays["shard_bucket"] = arrays["shard_bucket"].copy()
        arrays["shard_bucket"][3] = 3

    rel = rewrite_segment(directory, forge)
    for load in (load_index, load_manifest):
        with pytest.raises(ShardFormatError, match=rf"{rel}: shard row 3 is in bucket 3, the root lists 3 buckets"):
            load(directory)


def test_a_segment_without_shard_bucket_in_a_bucketed_dataset_is_refused(tmp_path):
    directory = make_bucketed_dataset(str(tmp_path / "ds"), BUCKETS, SAMPLES)
    rel = rewrite_segment(directory, lambda arrays: arrays.pop("shard_bucket"))
    for load in (load_index, load_manifest):
        with pytest.raises(ShardFormatError, match=rf"{rel}: no shard_bucket member in a bucketed dataset"):
            load(directory)


def test_a_shard_bucket_member_in_a_version_3_dataset_is_refused(tmp_path):
    directory = str(tmp_path / "ds")
    make_dataset(directory, (9, 7), samples_per_shard=4)

    def forge(arrays):
        arrays["shard_bucket"] = np.zeros(len(arrays["shard_samples"]), "<u2")

    rel = rewrite_segment(directory, forge)
    for load in (load_index, load_manifest):
        with pytest.raises(ShardFormatError, match=rf"{rel}: has a shard_bucket member but its root is not"):
            load(directory)


def test_the_writer_refuses_a_bucket_it_does_not_have_and_a_wrong_shape(tmp_path):
    writer = InputShardWriter(str(tmp_path), "input-0", 16, 16, 4, buckets=[(8, 4), (4, 8)])
    with pytest.raises(ValueError, match=r"bucket 2: this writer has 2 bucket"):
        writer.add(np.zeros((8, 4, 3), np.uint8), {"key": "a"}, "input-0.tar", bucket=2)
    with pytest.raises(ValueError, match=r"image \(8, 4, 3\) uint8 != \(4, 8, 3\) uint8"):
        writer.add(np.zeros((8, 4, 3), np.uint8), {"key": "a"}, "input-0.tar", bucket=1)
    writer.abort()
    assert not [n for n in os.listdir(tmp_path / "shards") if not n.startswith(".")]


def test_a_bucketed_shard_entry_round_trips_through_a_task_result(tmp_path):
    """The job hands entries back as dicts (``asdict``): the bucket travels with them."""
    from dataclasses import asdict

    entry = ShardEntry("shards/a-00000.npy", "shards/a-00000.jsonl", 1, 128 + 3, "0" * 32, 1, "0" * 32, "a",
                       "xxh3_128", 2)
    assert ShardEntry(**asdict(entry)) == entry and asdict(entry)["bucket"] == 2
    assert "bucket" not in entry.to_json()  # a version 1/2 entry never has one


def test_a_single_shape_index_is_the_bytes_it_was_before_buckets(tmp_path):
    """Segments are named by their sha256: the same names as shardio wrote before version 4 (pinned from
    it) prove the same bytes, for a dataset written by the writer and for a history of commits,
    replacements, drops and compactions."""
    from tests.index_steps import run_steps

    written = str(tmp_path / "written")
    make_dataset(written)  # raw, 117 samples in three inputs
    assert [s["path"] for s in root(written)["segments"]] == [
        "index/f43ea0ef8d565f014f8e6034c10d7f8c93d741afa115af556216447404ffdd33.npz"]
    steps = str(tmp_path / "steps")
    run_steps(steps, 20)
    assert [s["path"][6:18] for s in root(steps)["segments"]] == [
        "fdfa2ab551a4", "cae3de638c90", "5ce2f86e147b", "77476ce63d74", "544802605d59", "7f7295df5cac",
        "3d8b3ac9b714"]
    for directory in (written, steps):
        doc = root(directory)
        assert doc["format_version"] == 3 and "buckets" not in doc
        for name in os.listdir(os.path.join(directory, "index")):
            assert "shard_bucket" not in segment_arrays(directory, f"index/{name}")


@pytest.mark.parametrize("version", [1, 2])
def test_an_old_dataset_upgraded_by_a_commit_stays_single_shape_version_3(tmp_path, version):
    from shardio.write import directory as dataset_dir
    from tests.legacy_format import as_legacy, write_legacy

    out = str(tmp_path / "ds")
    make_dataset(out, (9, 7))
    doc = as_legacy(out)
    if version == 1:  # sha256 entries only
        import hashlib

        for entry in doc["shards"]:
            for rel_key, old, new in (("path", "xxh3_128", "sha256"), ("meta_path", "meta_xxh3_128", "meta_sha256")):
                del entry[old]
                entry[new] = hashlib.sha256(open(os.path.join(out, entry[rel_key]), "rb").read()).hexdigest()
        doc["format_version"] = 1
        write_legacy(out, doc)
    assert root(out)["format_version"] == version
    snapshot = open_dataset(out, verify=True)
    assert not snapshot.is_bucketed and snapshot.buckets == ((8, 8),) and len(snapshot) == 16
    assert snapshot.shard_buckets.tolist() == [0] * len(snapshot.shards)
    dataset_dir.drop_inputs(out, ["input-1.tar"])  # a commit: the upgrade
    doc = root(out)
    assert doc["format_version"] == 3 and "buckets" not in doc
    assert "shard_bucket" not in segment_arrays(out, doc["segments"][0]["path"])
    assert len(open_dataset(out, verify=True)) == 9


def test_an_old_manifest_that_says_bucket_is_refused(tmp_path):
    from tests.legacy_format import as_legacy, write_legacy

    out = str(tmp_path / "ds")
    make_dataset(out, (4,))
    doc = as_legacy(out)
    doc["config"] = {**doc["config"], "mode": "bucket", "buckets": [[8, 8]]}
    write_legacy(out, doc)
    with pytest.raises(ShardFormatError, match=r"manifest\.json: format_version 2 with config mode 'bucket'"):
        load_index(out)
