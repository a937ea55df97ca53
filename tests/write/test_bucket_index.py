"""A bucketed dataset's index through the write side: compaction carries ``shard_bucket`` (the columns
merge gives the object path's bytes), the editable index and incremental commits (an input replaced with
other buckets), retention, and kill -9 during commits and compactions, as for a single-shape dataset."""

from __future__ import annotations

import dataclasses
import os
import random

import numpy as np
import pytest

from bucket_fixtures import BUCKETS, key_bucket, make_bucketed_dataset
from shardio.format.index import Delta, decode_segment, encode_segment
from shardio.format.manifests import load_index, load_manifest
from shardio.read.snapshot import open_dataset
from shardio.write import directory as dataset_dir
from shardio.write import retention
from shardio.write.shard_writer import InputShardWriter
from tests.index_steps import STEP_BUCKETS, entries, expected_inputs, run_steps
from tests.format.test_segment_merge import columns_merge, object_merge, random_history

def bucketed_history(seed: int, segments: int = 12) -> list[Delta]:
    """``random_history``'s deltas as a bucketed dataset's: each shard in a random one of 5 buckets."""
    rng = random.Random(seed)
    out = []
    for delta in random_history(seed, segments):
        inputs = {name: (entry, [dataclasses.replace(e, bucket=rng.randrange(5)) for e in shards], listed)
                  for name, (entry, shards, listed) in delta.inputs.items()}
        out.append(Delta(inputs, delta.removed, bucketed=True))
    return out


@pytest.mark.parametrize("seed", range(20))
def test_compaction_carries_the_bucket_column_as_the_object_path_does(seed):
    blobs = [encode_segment(d) for d in bucketed_history(seed)]
    rng = random.Random(seed)
    for _ in range(6):
        start = rng.randrange(len(blobs))
        run = blobs[start:start + rng.randint(1, 8)]
        for from_start in (start == 0, True, False):
            merged = columns_merge(run, from_start)
            assert merged == object_merge(run, from_start)
            if merged is not None:
                delta = decode_segment(merged, "merged")
                assert delta.bucketed
                live = {}
                for blob in run:  # the newest segment naming an input decides its shards' buckets
                    d = decode_segment(blob, "x")
                    for name in d.removed:
                        live.pop(name, None)
                    live.update({n: [(e.path, e.bucket) for e in v[1]] for n, v in d.inputs.items()})
                assert {n: [(e.path, e.bucket) for e in v[1]] for n, v in delta.inputs.items()} == live


def test_a_single_shape_merge_has_no_bucket_column():
    blobs = [encode_segment(d) for d in random_history(3)]
    merged = columns_merge(blobs[:8], True)
    assert merged is not None and not decode_segment(merged, "m").bucketed
    assert b"shard_bucket" not in merged


def content(directory: str) -> tuple[dict, list[tuple[str, int]]]:
    manifest = load_manifest(directory)
    doc = manifest.to_json()
    return ({"shards": doc["shards"], "inputs": doc["inputs"], "samples": doc["samples"]},
            [(e.path, e.bucket) for e in manifest.shards])


def expected_buckets(steps: int) -> list[tuple[str, int]]:
    return sorted((e.path, e.bucket) for name, version in expected_inputs(steps).items()
                  for e in entries(name, version, buckets=True))


def test_commits_and_compactions_of_a_bucketed_dataset_keep_every_shards_bucket(tmp_path):
    out = str(tmp_path / "ds")
    steps = 200
    index = run_steps(out, steps, buckets=True)
    assert index.format_version == 4 and index.buckets == tuple(map(tuple, STEP_BUCKETS))
    manifest = load_manifest(out)
    assert len(manifest.segments) < steps and max(s.tier for s in manifest.segments) >= 1  # compacted
    assert sorted((e.path, e.bucket) for e in manifest.shards) == expected_buckets(steps)
    assert index.shards.bucket_ids().tolist() == [e.bucket for e in manifest.shards]
    for name in os.listdir(os.path.join(out, "index")):  # every segment ever written has the column
        with np.load(os.path.join(out, "index", name)) as z:
            assert "shard_bucket" in z.files and z["shard_bucket"].dtype == np.dtype("<u2")


def test_kill_9_during_bucketed_commits_and_compactions_then_rerun_is_the_uninterrupted_result(tmp_path):
    from tests.format.test_index import _kill_loop

    steps = 100
    whole, killed = str(tmp_path / "whole"), str(tmp_path / "killed")
    run_steps(whole, steps, buckets=True)
    _kill_loop(killed, steps, kills=3, seed=32, buckets=True)
    assert content(killed) == content(whole)
    assert sorted(content(killed)[1]) == expected_buckets(steps)


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


def test_the_editable_index_refuses_a_bucket_the_dataset_does_not_have(tmp_path):
    out = make_bucketed_dataset(str(tmp_path / "ds"), BUCKETS, (2, 2, 2), inputs=1)
    with dataset_dir.writing(out):
        committed, _ = dataset_dir.load_committed(out)
        committer = dataset_dir.Committer(out, committed)
        bad = dataclasses.replace(entries("x.tar")[0], bucket=len(BUCKETS))
        with pytest.raises(ValueError, match=r"bucket 3, the dataset has 3"):
            committer.add_input("x.tar", size=1, mtime_ns=1, shards=[bad])
    # A single-shape dataset has one bucket: 0.
    plain = str(tmp_path / "plain")
    run_steps(plain, 3)
    with dataset_dir.writing(plain):
        committer = dataset_dir.Committer(plain, dataset_dir.load_committed(plain)[0])
        with pytest.raises(ValueError, match=r"bucket 1, the dataset has 1"):
            committer.add_input("y.tar", size=1, mtime_ns=1,
                                shards=[dataclasses.replace(entries("y.tar")[0], bucket=1)])



def test_the_benchs_synthetic_bucketed_index_is_a_valid_version_4_index(tmp_path):
    """``bench.synthetic_index --buckets``, what ``bench.bucket_index`` measures: it loads, checked, with
    shard ``i`` in bucket ``7 i % buckets``; without buckets it is a version 3 index."""
    from bench.bucket_index import child
    from bench.synthetic_index import write_index

    bucketed, plain = str(tmp_path / "b"), str(tmp_path / "p")
    write_index(bucketed, 1000, buckets=20)
    write_index(plain, 1000)
    index = load_index(bucketed)
    assert index.format_version == 4 and len(index.buckets) == 20 == len(set(index.buckets))
    assert index.shards.bucket_ids().tolist() == [(7 * i) % 20 for i in range(1000)]
    assert load_index(plain).format_version == 3 and not load_index(plain).is_bucketed
    assert child(bucketed)["buckets"] == 20 and child(plain)["buckets"] == 1
