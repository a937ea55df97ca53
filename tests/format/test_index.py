"""Format 3's index (shardio/format/index.py, the commit in shardio/write/directory.py): a commit writes one
segment of what it adds and a small root; compaction keeps the segments few; kill -9 at any moment of
commits and compactions, then a rerun, gives the uninterrupted content (local and object storage); two
writers never both commit; a reader of generation G keeps reading while later commits and compactions
land; old (format 1/2) datasets read and are upgraded by a commit like any other. Format version 4
(shardio/format/spec.py, "Buckets"): a bucketed dataset written through the real writer and commit loads with
each shard at its own bucket's shape (raw and JPEG), its root and segments say what the spec says, forged
roots and segments are refused naming the file, commits and compactions keep every shard's bucket, and a
single-shape dataset is written exactly as before (version 3, no ``buckets``, no ``shard_bucket``)."""

from __future__ import annotations

import hashlib
import json
import os
import random
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

import shardio
from shardio.errors import CommitConflict, OutputLocked, ShardFormatError, ShardIntegrityError
from shardio.format import BUCKET_FORMAT_VERSION, FORMAT_VERSION, READ_VERSIONS, ShardEntry
from shardio.format.index import COMPACT_FANOUT, decode_segment
from shardio.format.manifests import list_generations, load_index, load_manifest, read_root
from shardio.store.backends import for_path
from shardio.write import commit as dataset_commit
from shardio.write import directory as dataset_dir
from shardio.write import retention
from shardio.read.snapshot import open_dataset
from shardio.write.shard_writer import InputShardWriter, write_manifest
from tests.bucket_fixtures import (BUCKETS, bucket_order, key_bucket, key_index, make_bucketed_dataset,
                                   rewrite_segment, root, segment_arrays, write_root)
from tests.dataset_fixtures import make_dataset, pixel_indices, write_inputs
from tests.index_steps import STEP_BUCKETS, entries, expected_inputs, run_steps
from tests.layout_fixtures import Layout
from tests.legacy_format import as_legacy
from tests.paths import REPO_ROOT

REPO = REPO_ROOT


def stored_indices(directory: str) -> list[int]:
    """Every sample's index in dataset order, from its pixels (``make_dataset``'s encoding), checksums
    verified first."""
    snapshot = shardio.open_dataset(directory, verify=True)
    return [int(p[0, 0, 0]) + (int(p[0, 0, 1]) << 8) for i in range(len(snapshot.shards))
            for p in snapshot.pixels(i)]


def content(directory: str) -> dict:
    """The dataset as a reader sees it: shards in dataset order and inputs (not the commit time)."""
    doc = load_manifest(directory).to_json()
    return {"shards": doc["shards"], "inputs": doc["inputs"], "samples": doc["samples"]}


def segment_files(directory: str) -> set[str]:
    store = for_path(directory)
    return {f"index/{n}" for n in store.list_dir(store.join(directory, "index"))}


def named_segments(directory: str) -> set[str]:
    named = {s["path"] for s in read_root(directory)["segments"]}
    for generation in list_generations(directory):
        named |= {s["path"] for s in read_root(directory, generation).get("segments", [])}
    return named


def test_a_commit_writes_one_segment_of_what_it_adds_and_a_root_of_a_few_kb(tmp_path):
    small, big = str(tmp_path / "small"), str(tmp_path / "big")
    written = {}
    for directory, steps in ((small, 3), (big, 200)):
        manifest = run_steps(directory, steps)
        before = segment_files(directory)
        committer = dataset_dir.Committer(directory, manifest)
        with dataset_dir.writing(directory):
            committer.add_input("new.tar", 1, 1, entries("new.tar"))
            committer.maybe_commit(force=True)
        added = segment_files(directory) - before
        root = os.path.getsize(os.path.join(directory, "manifest.json"))
        written[directory] = root, added
    (small_root, small_added), (big_root, big_added) = written[small], written[big]
    [segment] = big_added  # no compaction due at this count: one new segment
    delta = decode_segment(open(os.path.join(big, segment), "rb").read(), segment)
    assert list(delta.inputs) == ["new.tar"] and len(delta.inputs["new.tar"][1]) == 3 and not delta.removed
    assert [os.path.getsize(os.path.join(d, s)) for d, s in ((small, next(iter(small_added))), (big, segment))] \
        == [os.path.getsize(os.path.join(big, segment))] * 2, "the same commit costs the same bytes"
    # The root grows with the segments (a few, O(log N)), not with the 550 shards.
    assert small_root < big_root < 4_000, (small_root, big_root)
    assert sorted(load_manifest(big).inputs) == sorted([*expected_inputs(200), "new.tar"])


def test_the_index_round_trips_every_field_and_shards_of_an_unlisted_input(tmp_path):
    out = str(tmp_path / "ds")
    manifest = write_inputs(out, (5, 3), lambda i, n, name: {"key": f"s{i}"}, height=4, width=4, samples_per_shard=2)
    manifest.inputs["input-0.tar"].etag = '"abc-1"'
    manifest.inputs["input-1.tar"].failed = 2
    orphan = entries("bench.tar")  # shards whose input no entry lists (bench datasets build such manifests)
    manifest.shards.extend(orphan)
    write_manifest(out, manifest)
    loaded = load_manifest(out)
    assert loaded.to_json()["shards"] == manifest.to_json()["shards"]
    assert loaded.to_json()["inputs"] == manifest.to_json()["inputs"] and "bench.tar" not in loaded.inputs
    root = json.load(open(os.path.join(out, "manifest.json")))
    assert root["format_version"] == 3 and root["shard_count"] == len(manifest.shards)
    assert (root["samples"], root["input_count"], root["failed"]) == (manifest.samples, 2, 2)
    assert root["bytes"] == sum(e.bytes for e in manifest.shards)


def test_compaction_keeps_segments_few_and_rewrites_each_entry_a_few_times(tmp_path):
    out = str(tmp_path / "ds")
    steps = 300
    run_steps(out, steps)
    manifest = load_manifest(out)
    assert {name: int(manifest.inputs[name].size - 100) for name in manifest.inputs} == expected_inputs(steps)
    tiers = max(s.tier for s in manifest.segments) + 1
    assert len(manifest.segments) <= (COMPACT_FANOUT - 1) * tiers, [s.rows for s in manifest.segments]
    # Every segment ever written is still on disk (retention keeps 24 h of roots): count the rewrites.
    copies: dict[str, int] = {}
    for rel in segment_files(out):
        for name, (_, shards, _) in decode_segment(open(os.path.join(out, rel), "rb").read(), rel).inputs.items():
            for entry in shards:
                copies[entry.path] = copies.get(entry.path, 0) + 1
    assert max(copies.values()) <= tiers + 1, (max(copies.values()), tiers)


def _kill_loop(directory: str, steps: int, kills: int, seed: int, buckets: bool = False) -> None:
    """Run the steps as subprocesses SIGKILLed at random moments; between kills the dataset is always
    loadable and a prefix of the run's states; the last run finishes."""
    rng = random.Random(seed)
    extra = ["--buckets"] if buckets else []
    for _ in range(kills):
        run = subprocess.Popen([sys.executable, "-m", "tests.index_steps", directory, str(steps), *extra], cwd=REPO)
        time.sleep(rng.uniform(0.3, 2.5))
        run.kill()
        run.wait()
        if for_path(directory).exists(for_path(directory).join(directory, "manifest.json")):
            load_manifest(directory)  # never half-visible
    subprocess.run([sys.executable, "-m", "tests.index_steps", directory, str(steps), *extra], cwd=REPO, check=True)


def shard_buckets(directory: str) -> list[tuple[str, int]]:
    """Each shard's path and bucket (0 in a single-shape dataset), sorted."""
    return sorted((e.path, e.bucket) for e in load_manifest(directory).shards)


def expected_buckets(steps: int, buckets: bool) -> list[tuple[str, int]]:
    """``shard_buckets`` of ``index_steps``' dataset after ``steps`` steps."""
    return sorted((e.path, e.bucket) for name, version in expected_inputs(steps).items()
                  for e in entries(name, version, buckets=buckets))


@pytest.mark.parametrize("layout, steps, kills, seed", [("single", 150, 4, 24), ("buckets", 100, 3, 32)],
                         indirect=["layout"])
def test_kill_9_during_commits_and_compactions_then_rerun_is_the_uninterrupted_result(tmp_path, layout: Layout,
                                                                                      steps, kills, seed):
    whole, killed = str(tmp_path / "whole"), str(tmp_path / "killed")
    run_steps(whole, steps, buckets=layout.bucketed)
    _kill_loop(killed, steps, kills=kills, seed=seed, buckets=layout.bucketed)
    assert content(killed) == content(whole)
    assert shard_buckets(killed) == shard_buckets(whole) == expected_buckets(steps, layout.bucketed)
    # Leftovers cleaned: every segment on disk is named by a root, and nothing half-written remains.
    assert segment_files(killed) == named_segments(killed)
    assert not [n for n in os.listdir(os.path.join(killed, "index")) if n.startswith(".tmp-")]


@pytest.mark.slow
def test_kill_9_on_object_storage_then_rerun_is_the_uninterrupted_result(s3_bucket, tmp_path):
    steps = 60
    whole, killed = str(tmp_path / "whole"), f"s3://{s3_bucket}/killed"
    run_steps(whole, steps)
    _kill_loop(killed, steps, kills=3, seed=7)
    assert content(killed) == content(whole)
    assert segment_files(killed) == named_segments(killed)


def test_two_writers_never_both_commit_locally(tmp_path):
    out = str(tmp_path / "ds")
    run_steps(out, 10)
    with dataset_dir.writing(out):
        with pytest.raises(OutputLocked):
            with dataset_dir.writing(out):
                pass


@pytest.mark.slow
def test_two_writers_from_one_generation_never_both_commit_on_object_storage(s3_bucket):
    # The lease is the first guard; this is the second: the root is replaced only If-Match the ETag the
    # writer read, so a writer whose lease lapsed cannot publish over a newer commit.
    out = f"s3://{s3_bucket}/ds"
    run_steps(out, 10)
    first, second = load_manifest(out), load_manifest(out)
    winner = dataset_dir.Committer(out, first)
    winner.add_input("a.tar", 1, 1, entries("a.tar"))
    winner.maybe_commit(force=True)
    second.inputs["b.tar"] = second.inputs.pop("in-0000.tar")
    with pytest.raises(CommitConflict):
        dataset_dir.commit(out, second)
    assert "a.tar" in load_manifest(out).inputs and "b.tar" not in load_manifest(out).inputs
    with dataset_dir.writing(out):
        current = load_manifest(out)
        dataset_dir.clean_leftovers(out, current)  # the loser's segment and root, named by no kept root, go
    assert segment_files(out) == named_segments(out)
    load_manifest(out)  # the winner's generation, whole


def test_a_reader_of_generation_g_keeps_reading_while_commits_and_compactions_land(tmp_path):
    out = str(tmp_path / "ds")
    make_dataset(out, (9, 7))
    snapshot = shardio.open_dataset(out)
    generation = snapshot.generation
    made = time.time() - 3600  # made by an earlier run, an hour ago: not a passing generation of this one
    os.utime(os.path.join(out, "manifests", f"{generation:010d}.json"), (made, made))
    manifest = load_manifest(out)
    committer = dataset_dir.Committer(out, manifest)
    with dataset_dir.writing(out):
        committer.drop_input("input-0.tar")
        committer.maybe_commit(force=True)
        for i in range(3 * COMPACT_FANOUT):  # enough commits for compactions
            committer.add_input(f"x-{i}.tar", 1, 1, entries(f"x-{i}.tar"))
            committer.maybe_commit(force=True)
        retention.collect(out, load_index(out), retention.Retention())
    assert len(load_manifest(out).segments) < 3 * COMPACT_FANOUT
    assert [int(p[0, 0, 0]) for i in range(len(snapshot.shards)) for p in snapshot.pixels(i)] == list(range(16))
    reopened = shardio.open_dataset(out, generation=generation)
    assert [int(p[0, 0, 0]) for i in range(len(reopened.shards)) for p in reopened.pixels(i)] == list(range(16))


@pytest.mark.parametrize("sha256", [False, True], ids=["v2", "v1"])
def test_an_old_dataset_reads_and_its_first_commit_upgrades_it_and_a_killed_upgrade_leaves_it_readable(
        tmp_path, monkeypatch, sha256):
    out = str(tmp_path / "ds")
    make_dataset(out, (9, 7))
    doc = as_legacy(out)
    if sha256:  # format 1: every entry sha256, as shardio wrote before xxh3_128
        for entry in doc["shards"]:
            for rel_key, key in (("path", "sha256"), ("meta_path", "meta_sha256")):
                del entry["xxh3_128" if key == "sha256" else "meta_xxh3_128"]
                entry[key] = hashlib.sha256(open(os.path.join(out, entry[rel_key]), "rb").read()).hexdigest()
        doc["format_version"] = 1
        for path in (os.path.join(out, "manifest.json"),
                     os.path.join(out, "manifests", f"{doc['generation']:010d}.json")):
            json.dump(doc, open(path, "w"), indent=1)
    legacy = open(os.path.join(out, "manifest.json"), "rb").read()
    assert json.loads(legacy)["format_version"] == (1 if sha256 else 2)
    assert stored_indices(out) == list(range(16))
    before = content(out)

    # A killed upgrade: its segment is written, its root never published: the old manifest is the dataset.
    def killed(*args, **kwargs):
        raise KeyboardInterrupt("killed before the root")
    monkeypatch.setattr(dataset_commit, "_publish_generation", killed)
    with dataset_dir.writing(out), pytest.raises(KeyboardInterrupt):
        committer = dataset_dir.Committer(out, load_manifest(out))
        committer.add_input("new.tar", 1, 1, entries("new.tar"))
        committer.maybe_commit(force=True)
    monkeypatch.undo()
    assert open(os.path.join(out, "manifest.json"), "rb").read() == legacy and content(out) == before
    assert segment_files(out), "the killed upgrade wrote its segment"

    with dataset_dir.writing(out):  # the next run: leftovers cleaned, the upgrade committed
        existing, _ = dataset_dir.load_committed(out)
        dataset_dir.clean_leftovers(out, existing)
        assert not segment_files(out)
        dataset_dir.commit(out, existing)  # nothing new: the upgrade alone, a commit like any other
        committer = dataset_dir.Committer(out, existing)
        committer.drop_input("input-1.tar")
        committer.maybe_commit(force=True)
    root = json.load(open(os.path.join(out, "manifest.json")))
    assert root["format_version"] == 3 and len(root["segments"]) == 2  # everything, then the drop
    assert stored_indices(out) == list(range(9))  # sha256 entries stay sha256 in the index (verified)
    old_generation = json.loads(legacy)["generation"]
    assert content(out)["shards"] == [e for e in before["shards"] if e["input"] == "input-0.tar"]
    assert load_manifest(out, old_generation).to_json()["shards"] == before["shards"]  # the old root still reads


def test_a_forged_or_corrupt_segment_is_named_and_nothing_is_read(tmp_path):
    out = str(tmp_path / "ds")
    run_steps(out, 6)
    path = os.path.join(out, "manifest.json")
    root = json.load(open(path))
    segment = root["segments"][0]["path"]
    data = bytearray(open(os.path.join(out, segment), "rb").read())
    data[-30] ^= 0xFF
    open(os.path.join(out, segment), "wb").write(bytes(data))
    with pytest.raises(ShardIntegrityError, match=rf"{segment} is {len(data)} bytes and hashes to"):
        load_manifest(out)
    root["segments"][0]["path"] = "index/../../victim.npz"
    json.dump(root, open(path, "w"))
    with pytest.raises(ShardFormatError, match=r"unsafe segment path 'index/\.\./\.\./victim\.npz'"):
        load_manifest(out)


def test_a_stranger_checks_shards_with_xxh128sum_from_the_index(tmp_path):
    out = str(tmp_path / "ds")
    make_dataset(out, (9,))
    listing = subprocess.run([sys.executable, "-m", "shardio.format.manifests", out], capture_output=True, text=True,
                             check=True, cwd=REPO).stdout.splitlines()
    import xxhash
    assert len(listing) == 2 * len(load_manifest(out).shards)
    for line in listing:
        digest, rel = line.split("  ")
        assert xxhash.xxh3_128(open(os.path.join(out, rel), "rb").read()).hexdigest() == digest
    assert stored_indices(out) == list(range(9))


def test_the_roots_totals_are_the_datasets_after_adds_drops_and_replacements(tmp_path):
    out = str(tmp_path / "ds")
    run_steps(out, 37)  # a Committer keeps the totals as it goes: they must equal a count
    root, manifest = read_root(out), load_manifest(out)
    assert {k: root[k] for k in ("samples", "shard_count", "input_count", "bytes", "meta_bytes", "failed")} == {
        "samples": manifest.samples, "shard_count": len(manifest.shards), "input_count": len(manifest.inputs),
        "bytes": sum(e.bytes for e in manifest.shards), "meta_bytes": sum(e.meta_bytes for e in manifest.shards),
        "failed": sum(i.failed for i in manifest.inputs.values())}
    assert [(e.input, e.path) for e in manifest.shards] == sorted((e.input, e.path) for e in manifest.shards)


def test_an_input_added_again_under_the_same_shard_names_is_listed_once_and_retires_nothing(tmp_path):
    out = str(tmp_path / "ds")
    dataset_dir.ensure_output_dir(out)
    with dataset_dir.writing(out):
        committer = dataset_dir.Committer(out, shardio.format.Manifest(shape=(2, 2, 3),
                                                                       config={"height": 2, "width": 2}, versions={}))
        committer.add_input("a.tar", 1, 1, entries("a.tar"))
        committer.add_input("b.tar", 1, 1, entries("b.tar"))
        committer.maybe_commit(force=True)
        committer.add_input("a.tar", 1, 1, entries("a.tar"))  # a repair: the same names are the same bytes
        committer.maybe_commit(force=True)
    manifest = load_manifest(out)
    assert [e.path for e in manifest.shards] == [e.path for name in ("a.tar", "b.tar") for e in entries(name)]
    assert manifest.retired == [] and read_root(out)["shard_count"] == 6


# --- format version 4: buckets --------------------------------------------------------------------------------

SAMPLES = (20, 27, 13)


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
    from tests.legacy_format import as_legacy, write_legacy

    out = str(tmp_path / "ds")
    make_dataset(out, (9, 7))
    doc = as_legacy(out)
    if version == 1:  # sha256 entries only
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


def test_commits_and_compactions_of_a_bucketed_dataset_keep_every_shards_bucket(tmp_path):
    out = str(tmp_path / "ds")
    steps = 200
    index = run_steps(out, steps, buckets=True)
    assert index.format_version == 4 and index.buckets == tuple(map(tuple, STEP_BUCKETS))
    manifest = load_manifest(out)
    assert len(manifest.segments) < steps and max(s.tier for s in manifest.segments) >= 1  # compacted
    assert sorted((e.path, e.bucket) for e in manifest.shards) == expected_buckets(steps, True)
    assert index.shards.bucket_ids().tolist() == [e.bucket for e in manifest.shards]
    for name in os.listdir(os.path.join(out, "index")):  # every segment ever written has the column
        with np.load(os.path.join(out, "index", name)) as z:
            assert "shard_bucket" in z.files and z["shard_bucket"].dtype == np.dtype("<u2")
