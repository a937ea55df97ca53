"""The index a run edits (``shardio.write.editable_index``): what is committed is read from the segments
themselves, exactly as ``load_manifest`` folds them; the run's changes are let go at each commit, kept
when a commit fails; a hand-written segment whose names are not sorted is still searched right; a shard in a
bucket the dataset does not have is refused."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from shardio.format.manifests import load_index, load_manifest
from shardio.write import commit as dataset_commit
from shardio.write import directory as dataset_dir
from shardio.write.editable_index import EditableIndex, _SortedNames
from tests.bucket_fixtures import BUCKETS, make_bucketed_dataset
from tests.index_steps import entries, expected_inputs, run_steps


@pytest.mark.parametrize("steps", [1, 9, 40, 130])
def test_every_committed_input_is_found_in_the_segments_as_load_manifest_folds_them(tmp_path, steps):
    out = str(tmp_path / "ds")
    run_steps(out, steps)  # adds, drops, replacements; compactions along the way
    index, manifest = EditableIndex.of(load_index(out)), load_manifest(out)
    assert len(index.segments) >= 1
    for name, entry in manifest.inputs.items():
        found = index.input(name)
        assert found is not None and (found.size, found.mtime_ns, found.samples, found.failed, found.etag) == (
            entry.size, entry.mtime_ns, entry.samples, entry.failed, entry.etag)
        assert index.shards_of(name) == [e for e in manifest.shards if e.input == name]
    dropped = {f"in-{i:04d}.tar" for i in range(steps)} - set(expected_inputs(steps))
    assert all(index.input(name) is None for name in dropped)
    assert index.input("never-committed.tar") is None and index.input("in-" + "9" * 300 + ".tar") is None
    assert {k: index.totals[k] for k in ("samples", "shard_count", "input_count")} == {
        "samples": manifest.samples, "shard_count": len(manifest.shards), "input_count": len(manifest.inputs)}


def test_a_commit_lets_the_changes_go_and_reads_them_back_from_its_segment(tmp_path):
    out = str(tmp_path / "ds")
    run_steps(out, 12)
    with dataset_dir.writing(out):
        committer = dataset_dir.Committer(out, load_index(out), run="test")
        for i in range(5):
            committer.add_input(f"new-{i}.tar", 10 + i, 7, entries(f"new-{i}.tar"), etag=f'"e{i}"')
        committer.drop_input("in-0000.tar")
        assert len(committer.index.changed) == 5 and committer.index.gone == {"in-0000.tar"}
        committer.maybe_commit(force=True)
        assert committer.index.changed == {} and committer.index.gone == set()  # held until the commit only
        assert committer.index.input("new-3.tar").etag == '"e3"'  # now from the new segment
        assert committer.index.shards_of("new-3.tar") == entries("new-3.tar")
        assert committer.index.input("in-0000.tar") is None
        committer.add_input("new-3.tar", 99, 7, entries("new-3.tar", version=1))  # replaced: old files retired
        committer.maybe_commit(force=True)
    manifest = load_manifest(out)
    assert manifest.inputs["new-3.tar"].size == 99
    retired = {r.path for r in manifest.retired}
    assert {e.path for e in entries("new-3.tar")} <= retired and {e.path for e in entries("in-0000.tar")} <= retired


def test_a_failed_commit_keeps_the_changes_and_the_next_commit_writes_them(tmp_path, monkeypatch):
    out = str(tmp_path / "ds")
    run_steps(out, 6)
    with dataset_dir.writing(out):
        committer = dataset_dir.Committer(out, load_index(out))
        committer.add_input("late.tar", 1, 1, entries("late.tar"))
        real = dataset_commit._publish_generation

        def refused(*args, **kwargs):
            raise OSError("the store went away")

        monkeypatch.setattr(dataset_commit, "_publish_generation", refused)
        with pytest.raises(OSError):
            committer.maybe_commit(force=True)
        monkeypatch.setattr(dataset_commit, "_publish_generation", real)
        assert "late.tar" in committer.index.changed and committer.dirty
        committer.maybe_commit(force=True)
    assert "late.tar" in load_manifest(out).inputs


def test_names_not_sorted_in_a_hand_written_segment_are_still_found():
    names = np.array([b"b.tar", b"a.tar", b"c\xc3\xa9.tar", b"aa.tar"], dtype="S8")
    table = _SortedNames(names)
    for row, name in enumerate(names):
        assert table.find(bytes(name)) == row
    assert table.find(b"zz.tar") is None and table.find(b"a") is None and table.find(b"x" * 9) is None


def test_what_a_run_committed_reads_as_a_fresh_load_would_without_fetching_the_index_again(tmp_path):
    out = str(tmp_path / "ds")
    run_steps(out, 30)
    with dataset_dir.writing(out):
        committer = dataset_dir.Committer(out, load_index(out))
        for i in range(3 * 8):  # enough commits for a compaction of this run's own segments
            committer.add_input(f"new-{i:02d}.tar", 1, 1, entries(f"new-{i:02d}.tar"))
            committer.maybe_commit(force=True)
        committer.drop_input("in-0002.tar")
        committer.maybe_commit(force=True)
    fresh = load_index(out)
    held = committer.index.as_committed(fresh.path)
    assert [e.path for e in held.shards] == [e.path for e in fresh.shards]
    assert (held.generation, held.segments, held.samples, held.totals) == (
        fresh.generation, fresh.segments, fresh.samples, fresh.totals)
    assert held.retired == fresh.retired and held.committed_inputs() == fresh.committed_inputs()


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
