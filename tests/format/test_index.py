"""Format 3's index (shardio/format/index.py, the commit in shardio/write/directory.py): a commit writes one
segment of what it adds and a small root; compaction keeps the segments few; kill -9 at any moment of
commits and compactions, then a rerun, gives the uninterrupted content (local and object storage); two
writers never both commit; a reader of generation G keeps reading while later commits and compactions
land; old (format 1/2) datasets read and are upgraded by a commit like any other."""

from __future__ import annotations

import hashlib
import json
import os
import random
import subprocess
import sys
import time

import pytest

import shardio
from shardio.errors import CommitConflict, OutputLocked, ShardFormatError, ShardIntegrityError
from shardio.format.index import COMPACT_FANOUT, decode_segment
from shardio.format.manifests import list_generations, load_index, load_manifest, read_root
from shardio.store.backends import for_path
from shardio.write import commit as dataset_commit
from shardio.write import directory as dataset_dir
from shardio.write import retention
from shardio.write.shard_writer import write_manifest
from tests.dataset_fixtures import make_dataset, write_inputs
from tests.index_steps import entries, expected_inputs, run_steps
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


def test_kill_9_during_commits_and_compactions_then_rerun_is_the_uninterrupted_result(tmp_path):
    steps = 150
    whole, killed = str(tmp_path / "whole"), str(tmp_path / "killed")
    run_steps(whole, steps)
    _kill_loop(killed, steps, kills=4, seed=24)
    assert content(killed) == content(whole)
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
