"""The dataset-directory protocol without Ray (``shardio.write.directory``): generations, what retention keeps,
what a killed commit leaves, unsafe manifest paths, and restoring a corrupt ``manifest.json``; an input of a
bucketed dataset replaced with other buckets; a bucketed dataset kept by dropping inputs and restoring a root.
The end-to-end behaviour through ``preprocess`` is in tests/preprocess/test_retention_job.py."""

from __future__ import annotations

import dataclasses
import json
import os
from datetime import datetime, timedelta, timezone

import numpy as np
import pytest

from tests.bucket_fixtures import BUCKETS, key_bucket, make_bucketed_dataset
from tests.legacy_format import as_legacy

import shardio
from shardio.write import directory as dataset_dir
from shardio.write import retention
from shardio.errors import ShardFormatError
from shardio.format import RetiredFile
from shardio.format.manifests import generation_path, list_generations, load_index, load_manifest
from shardio.read.snapshot import open_dataset
from shardio.write.shard_writer import InputShardWriter, write_manifest
from tests.dataset_fixtures import make_dataset, retire_input
from tests.index_steps import run_steps



def shard_files(directory: str) -> set[str]:
    return {f"shards/{n}" for n in os.listdir(os.path.join(directory, "shards"))}


def test_each_commit_is_an_immutable_generation_and_manifest_json_the_current_one(tmp_path):
    out = str(tmp_path / "ds")
    make_dataset(out)
    assert retire_input(out, "input-1.tar") == 2
    assert list_generations(out) == [1, 2]
    current = open(os.path.join(out, "manifest.json"), "rb").read()
    assert open(generation_path(out, 2), "rb").read() == current
    assert json.loads(current)["generation"] == 2
    first = shardio.open_dataset(out, generation=1)
    assert first.generation == 1 and len(first) == 117
    assert shardio.open_dataset(out).generation == 2 and len(shardio.open_dataset(out)) == 72
    with pytest.raises(ShardFormatError, match="generation 7 is not kept"):
        shardio.open_dataset(out, generation=7)


def test_retired_files_stay_until_no_kept_generation_lists_them(tmp_path):
    out = str(tmp_path / "ds")
    make_dataset(out)
    retired = {rel for e in load_manifest(out).shards if e.input == "input-1.tar" for rel in (e.path, e.meta_path)}
    retire_input(out, "input-1.tar")  # generation 2; generation 1 lists the retired files
    now = datetime.now(timezone.utc)

    # Kept by count (generation 1 is one of the newest 3), then by time (it was current 1 h ago; a
    # generation current for seconds is a passing one: passing_minutes 0 keeps those by time too).
    assert retention.collect(out, load_manifest(out), retention.Retention(24, 3), now).files == []
    assert retention.collect(out, load_manifest(out), retention.Retention(24, 1, 0), now).files == []
    assert retired <= shard_files(out)
    assert shardio.open_dataset(out, generation=1, verify=True).generation == 1

    # Neither: collected, with generation 1's file; the current dataset is untouched.
    later = now + timedelta(hours=25)
    collected = retention.collect(out, load_manifest(out), retention.Retention(24, 1), later)
    assert set(collected.files) == retired and collected.generations == [1]
    assert not retired & shard_files(out) and list_generations(out) == [2]
    assert len(shardio.open_dataset(out, verify=True)) == 72
    # The next commit drops the collected entries from ``retired``.
    manifest = load_manifest(out)
    write_manifest(out, manifest)
    assert load_manifest(out).retired == []


def test_collect_never_deletes_a_file_the_current_generation_lists_again(tmp_path):
    out = str(tmp_path / "ds")
    make_dataset(out)
    manifest = load_manifest(out)
    listed = manifest.shards[0].path
    # A stale or hand-made entry naming a live shard: retention must not trust it over the shard list.
    manifest.retired.append(RetiredFile(listed, generation=1, since="2000-01-01T00:00:00+00:00"))
    write_manifest(out, manifest)
    collected = retention.collect(out, load_manifest(out), retention.Retention(0, 1))
    assert collected.files == [] and os.path.exists(os.path.join(out, listed))


def test_a_killed_commit_and_a_killed_run_leave_only_what_the_next_run_removes(tmp_path):
    out = str(tmp_path / "ds")
    make_dataset(out)
    retire_input(out, "input-2.tar")
    kept = shard_files(out)
    # A run killed mid-way: an unlisted shard, a temp file, and a generation file written before the
    # manifest.json rename that would have committed it.
    open(os.path.join(out, "shards", "input-9-00000.npy"), "wb").close()
    open(os.path.join(out, "manifests", ".tmp-0000000003.json.abcd"), "wb").close()
    open(generation_path(out, 3), "wb").write(open(generation_path(out, 2), "rb").read())
    assert dataset_dir.clean_leftovers(out, load_manifest(out)).removed == 3
    assert shard_files(out) == kept, "retired files are retention's, not leftovers"
    assert list_generations(out) == [1, 2]


@pytest.mark.parametrize("where", ["path", "meta_path", "input", "retired"])
@pytest.mark.parametrize("bad", ["../victim.npy", "/etc/passwd", "shards/../../victim.npy", "shards/x/../../v.npy",
                                 "shards/.tmp-x", "shards/", "victim.npy"])
def test_a_manifest_path_outside_shards_is_refused_at_load(tmp_path, where, bad):
    out = str(tmp_path / "ds")
    make_dataset(out, inputs=(3,))
    as_legacy(out)  # the one-document layout of format 1/2, which a hand edit can forge
    path = os.path.join(out, "manifest.json")
    doc = json.load(open(path))
    if where == "input":
        doc["inputs"]["input-0.tar"]["shards"][0] = bad
    elif where == "retired":
        doc["retired"] = [{"path": bad, "generation": 1, "since": "2000-01-01T00:00:00+00:00"}]
    else:
        doc["shards"][0][where] = bad
    json.dump(doc, open(path, "w"))
    with pytest.raises(ShardFormatError, match="unsafe shard path") as caught:
        load_manifest(out)
    assert repr(bad) in str(caught.value) and "kept generations: 1" in str(caught.value)


def test_a_corrupt_manifest_names_the_kept_generations_and_is_restored_from_the_newest_valid(tmp_path):
    out = str(tmp_path / "ds")
    make_dataset(out)
    retire_input(out, "input-0.tar")
    path = os.path.join(out, "manifest.json")
    good = open(path, "rb").read()
    open(path, "wb").write(good[: len(good) // 2])
    with pytest.raises(ShardFormatError) as caught:
        load_manifest(out)
    message = str(caught.value)
    assert "not valid JSON" in message and "kept generations: 1, 2" in message and "--repair" in message

    # The newest generation file is damaged too: the newest *valid* one wins.
    open(generation_path(out, 2), "w").write("{")
    restored = dataset_dir.recover_manifest(out)
    assert restored.generation == 1 and load_manifest(out).generation == 1 and len(shardio.open_dataset(out)) == 117

    for generation in list_generations(out):
        os.remove(generation_path(out, generation))
    open(path, "w").write("{")
    with pytest.raises(ShardFormatError, match="no kept generation can replace it"):
        dataset_dir.recover_manifest(out)


def test_files_honour_the_umask(tmp_path):
    previous = os.umask(0o027)
    try:
        out = str(tmp_path / "ds")
        make_dataset(out, inputs=(9,))
    finally:
        os.umask(previous)
    for root, _, names in os.walk(out):
        for name in names:
            assert os.stat(os.path.join(root, name)).st_mode & 0o777 == 0o640, os.path.join(root, name)


def _commit_times(out: str, times: dict[int, float]) -> None:
    """Generation g committed at ``times[g]`` (a generation file's mtime is its commit time)."""
    for generation, at in times.items():
        os.utime(generation_path(out, generation), (at, at))


def test_a_run_leaves_one_root_per_bucket_of_its_passing_generations_and_their_segments_go(tmp_path):
    out = str(tmp_path / "ds")
    run_steps(out, 40)  # one generation per commit, compactions along the way
    generations = list_generations(out)
    newest = generations[-1]
    # Run A commits generations 1..10 within 20 s, at the start of a 10-minute bucket; its result (10)
    # stays current for 2 h; run B then commits the rest within its own bucket, 2 s apart.
    bucket = 600
    start = (datetime.now(timezone.utc).timestamp() // bucket) * bucket - 10 * 3600
    times = {g: start + 2 * g for g in generations if g <= 10}
    times.update({g: start + 2 * 3600 + 2 * (g - 10) for g in generations if g > 10})
    _commit_times(out, times)
    os.utime(os.path.join(out, "manifest.json"), (times[newest], times[newest]))
    before = load_manifest(out).to_json()
    now = datetime.fromtimestamp(start + 3 * 3600, timezone.utc)

    every = retention.collect(out, load_manifest(out), retention.Retention(24, 3, 0), now)
    assert every.generations == [] and list_generations(out) == generations  # 0: the time rule alone

    collected = retention.collect(out, load_manifest(out), retention.Retention(24, 3), now)
    kept = [10, newest - 2, newest - 1, newest]
    assert list_generations(out) == kept and collected.kept_generations == kept
    named = set()
    for generation in kept:
        named |= {s["path"] for s in json.load(open(generation_path(out, generation)))["segments"]}
    assert {f"index/{n}" for n in os.listdir(os.path.join(out, "index"))} == named
    assert collected.segments  # the passing roots' own segments went with them
    assert load_manifest(out).to_json() == before
    for generation in kept:
        assert load_manifest(out, generation).generation == generation
    with pytest.raises(ShardFormatError, match=r"generation 5 is not kept"):
        load_manifest(out, 5)


def test_a_runs_result_superseded_seconds_later_by_the_next_run_is_kept_its_passing_ones_are_not(tmp_path):
    out = str(tmp_path / "ds")
    run_steps(out, 6)  # one run: several commits
    first_result = list_generations(out)[-1]
    run_steps(out, 12)  # the next run, seconds later, replays and goes on
    generations = list_generations(out)
    newest = generations[-1]
    retention.collect(out, load_manifest(out), retention.Retention(24, 1))
    kept = list_generations(out)
    assert first_result in kept and newest in kept  # the first run's result: kept by the time rule
    # Each run's passing generations: at most the newest of each 10-minute bucket (here one or two).
    assert len(kept) <= 2 + 2 * 2 < len(generations)
    assert load_manifest(out, first_result).generation == first_result


def _touch_listed(out: str) -> None:
    """Give every shard the current generation lists a file (the scripted steps write entries only)."""
    os.makedirs(os.path.join(out, "shards"), exist_ok=True)
    for rel in _listed(out):
        open(os.path.join(out, rel), "ab").close()


def _listed(out: str) -> set[str]:
    return {rel for entry in load_index(out).shards for rel in (entry.path, entry.meta_path)}


def test_after_several_runs_retention_collects_each_runs_result_and_the_files_only_it_listed(tmp_path):
    # Each run's first commit is a passing root that the run's own retention collects; the run before's
    # result must not then be kept for ever for want of its successor's commit time.
    out = str(tmp_path / "ds")
    results = []
    for run in range(1, 7):
        run_steps(out, 5 * run + 2)  # a run of several commits, each dropping and replacing inputs
        _touch_listed(out)
        with dataset_dir.writing(out):
            retention.collect(out, load_index(out), retention.Retention())  # the run's end, default rules
        results.append(list_generations(out)[-1])
    assert all(result in list_generations(out) for result in results)  # kept by the 24 h rule
    retired = {r.path for r in load_index(out).retired} & shard_files(out)  # files some run's commits listed
    assert len(retired) >= 12

    collected = retention.gc(out, retention.Retention(0, 1))
    newest = results[-1]
    assert collected.kept_generations == [newest] and list_generations(out) == [newest]
    assert set(collected.files) == retired and not retired & shard_files(out)
    assert shard_files(out) == _listed(out)


def _write_input(directory: str, name: str, assign: list[int], first: int) -> list:
    """Input ``name`` written through the real writer: sample ``j`` in bucket ``assign[j]``."""
    writer = InputShardWriter(directory, name.removesuffix(".tar"), 16, 16, 4, buckets=list(BUCKETS))
    for j, bucket in enumerate(assign):
        g = first + j
        pixels = np.full((*BUCKETS[bucket], 3), g % 251, np.uint8)
        writer.add(pixels, {"key": f"b{bucket}-{g:06d}", "tar": name, "member": f"{g}.jpg", "width": 1,
                            "height": 1, "cls": g, "txt": None, "json": None}, name, bucket=bucket)
    return writer.close(name)


def test_an_input_replaced_with_other_buckets_is_read_at_its_new_shapes_and_the_old_files_retire(tmp_path):
    out = make_bucketed_dataset(str(tmp_path / "ds"), BUCKETS, (6, 6, 6), samples_per_shard=4, inputs=2)
    before = load_manifest(out)
    old = [e for e in before.shards if e.input == "input-0.tar"]
    # The same input changed (a new mtime): all its samples now in bucket 2, with a new stem.
    with dataset_dir.writing(out):
        committed, _ = dataset_dir.load_committed(out)
        committer = dataset_dir.Committer(out, committed)
        shards = _write_input(out, "input-0-v2.tar", [2] * 7, 1000)
        committer.add_input("input-0.tar", size=7, mtime_ns=1, shards=[dataclasses.replace(e, input="input-0.tar")
                                                                          for e in shards])
        committer.maybe_commit(force=True)
    after = load_manifest(out)
    mine = [e for e in after.shards if e.input == "input-0.tar"]
    assert [e.bucket for e in mine] == [2, 2] and [e.samples for e in mine] == [4, 3]
    assert {r.path for r in after.retired} == {p for e in old for p in (e.path, e.meta_path)}
    snapshot = open_dataset(out, verify=True)
    for shard in range(len(snapshot.shards)):
        assert snapshot.pixels(shard).shape[1:3] == snapshot.shard_shape(shard)
        assert {key_bucket(k) for k in snapshot.meta(shard).keys} == {int(snapshot.shard_buckets[shard])}
    # Retention deletes the retired files of the old buckets once no kept generation lists them.
    with dataset_dir.writing(out):
        collected = retention.collect(out, load_index(out), retention.Retention(0, 1, 0))
    assert sorted(collected.files) == sorted(p for e in old for p in (e.path, e.meta_path))
    assert not any(os.path.exists(os.path.join(out, e.path)) for e in old)
    assert len(open_dataset(out)) == 7 + 9


@pytest.fixture(params=["raw", "jpeg"])
def bucketed(tmp_path, request) -> str:
    return make_bucketed_dataset(str(tmp_path / "bucketed"), BUCKETS, (20, 27, 13), encoding=request.param)


def test_dropping_inputs_and_restoring_a_root_keep_a_bucketed_dataset(bucketed):
    dataset_dir.drop_inputs(bucketed, ["input-1.tar"])
    index = load_index(bucketed)
    assert index.format_version == 4 and {e.input for e in index.shards} == {"input-0.tar"}
    assert index.shards.bucket_ids().tolist() == [e.bucket for e in index.shards]
    with open(os.path.join(bucketed, "manifest.json"), "w") as f:
        f.write("{not json")
    restored = dataset_dir.restore_manifest(bucketed)
    assert restored is not None and restored.buckets == BUCKETS
    snapshot = open_dataset(bucketed, verify=True)
    assert snapshot.is_bucketed and len(snapshot) == sum(e.samples for e in index.shards)
    assert json.load(open(os.path.join(bucketed, "manifest.json")))["format_version"] == 4
