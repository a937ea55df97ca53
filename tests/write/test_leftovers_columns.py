"""Which shard files ``clean_leftovers`` and ``collect`` keep, decided over the index's columns (hashed paths,
``shardio.format.string_hashes.string_hashes``) with no object per shard: the same files go and stay as when
they are given the ``Manifest``, after any history (adds, drops, replacements, compactions into several
segments, a version 1/2 manifest); a leftover goes, a listed or retired file never does."""

from __future__ import annotations

import concurrent.futures
import os
import shutil
from datetime import datetime, timedelta, timezone

import numpy as np
import pytest

from bench.synthetic_index import write_index
from shardio.format import RetiredFile, ShardEntry
from shardio.format.manifests import generation_path, list_generations, load_index, load_manifest, read_root
from shardio.format.string_hashes import hashes_in, string_hashes
from shardio.store.backends import for_path
from shardio.store.local import LocalStorage
from shardio.write import cleaning
from shardio.write import directory as dataset_dir
from shardio.write import retention
from shardio.write.shard_writer import write_manifest
from tests.dataset_fixtures import make_dataset, retire_input
from tests.index_steps import entries, run_steps
from tests.legacy_format import as_legacy

NON_ASCII_INPUT = "fötö-ünï-日本.tar"
LEFTOVERS = ("shards/in-9999-v0-00000.npy", "shards/in-9999-v0-00000.jsonl", "shards/läftövér-日本-00000.npy",
             "shards/.tmp-in-0003-v0-00000.npy.abcd")


def _fnv1a(data: bytes) -> int:
    value = 0xCBF29CE484222325
    for byte in data:
        value = ((value ^ byte) * 0x100000001B3) % 2**64
    return value


def shard_files(directory: str) -> set[str]:
    return {f"shards/{n}" for n in os.listdir(os.path.join(directory, "shards"))}


def touch(directory: str, paths) -> None:
    os.makedirs(os.path.join(directory, "shards"), exist_ok=True)
    for rel in paths:
        open(os.path.join(directory, rel), "wb").close()


def protected(directory: str) -> set[str]:
    """What the current generation lists or retires: the reference, exact (strings, not hashes)."""
    manifest = load_manifest(directory)
    return {p for e in manifest.shards for p in (e.path, e.meta_path)} | {r.path for r in manifest.retired}


def _history(directory: str, steps: int) -> None:
    """``run_steps`` (adds, drops, replacements, compactions), an input with a non-ASCII name, then a file for
    every path any kept generation lists or the current one retires, and a killed run's leftovers."""
    run_steps(directory, steps)
    every = {r.path for r in load_manifest(directory).retired}  # kept retired by the next commit: they exist
    for generation in list_generations(directory):
        every |= {p for e in load_manifest(directory, generation).shards for p in (e.path, e.meta_path)}
    touch(directory, every)
    with dataset_dir.writing(directory):
        committer = dataset_dir.Committer(directory, load_manifest(directory))
        committer.add_input(NON_ASCII_INPUT, size=5, mtime_ns=7, shards=entries(NON_ASCII_INPUT))
        committer.maybe_commit(force=True)
    touch(directory, {p for e in entries(NON_ASCII_INPUT) for p in (e.path, e.meta_path)} | set(LEFTOVERS))


@pytest.fixture(params=["segments", "one-segment", "legacy"])
def history(request, tmp_path) -> str:
    """A dataset with shard files and leftovers: an index of several segments; one compacted segment (the
    synthetic index, no object per shard even to write it); a version 1/2 manifest."""
    out = str(tmp_path / "history")
    if request.param == "one-segment":
        write_index(out, 200, per_input=7)
        touch(out, protected(out) | set(LEFTOVERS))
        return out
    _history(out, 15)
    if request.param == "legacy":
        as_legacy(out)
    else:
        assert len(read_root(out)["segments"]) >= 2, "the history should leave several segments"
        assert load_manifest(out).retired, "the last step replaces an input: its old files are retired"
    return out


def copies(directory: str, tmp_path) -> tuple[str, str]:
    a, b = str(tmp_path / "given-manifest"), str(tmp_path / "given-index")
    shutil.copytree(directory, a)
    shutil.copytree(directory, b)
    return a, b


def test_clean_leftovers_removes_the_same_files_given_the_manifest_or_the_index(history, tmp_path):
    by_manifest, by_index = copies(history, tmp_path)
    before = shard_files(history)
    expected = before & protected(history)
    assert set(LEFTOVERS) <= before - expected
    with dataset_dir.writing(by_manifest):
        removed_manifest = dataset_dir.clean_leftovers(by_manifest, load_manifest(by_manifest)).removed
    with dataset_dir.writing(by_index):
        removed_index = dataset_dir.clean_leftovers(by_index, load_index(by_index)).removed
    assert shard_files(by_manifest) == shard_files(by_index) == expected
    assert removed_manifest == removed_index == len(before - expected)


def test_a_leftover_goes_and_a_listed_or_retired_file_never_does_non_ascii_names_included(tmp_path):
    out = str(tmp_path / "ds")
    _history(out, 15)
    manifest = load_manifest(out)
    listed_non_ascii = {p for e in manifest.shards if e.input == NON_ASCII_INPUT for p in (e.path, e.meta_path)}
    retired = {r.path for r in manifest.retired}
    assert len(listed_non_ascii) == 6 and retired
    with dataset_dir.writing(out):
        dataset_dir.clean_leftovers(out, load_index(out))
    left = shard_files(out)
    assert not set(LEFTOVERS) & left
    assert listed_non_ascii | retired <= left
    assert {p for e in manifest.shards for p in (e.path, e.meta_path)} <= left


def test_without_a_committed_generation_every_shard_file_is_a_leftover(tmp_path):
    out = str(tmp_path / "ds")
    touch(out, LEFTOVERS)
    os.makedirs(os.path.join(out, "shards", "a-folder"))
    with dataset_dir.writing(out):
        assert dataset_dir.clean_leftovers(out, None).removed == len(LEFTOVERS)
    assert os.listdir(os.path.join(out, "shards")) == ["a-folder"]  # a folder is not a shard file


def _collect_history(directory: str, *, corrupt_kept: bool) -> dict[str, set[str]]:
    """Generations 1..4 with real shard files: 2 retires input-1, 3 retires input-2, 4 drops input-3 with
    forged ``retired`` entries (stamped generation 1, year 2000: past any retention) for its files, which
    generation 3 still lists, and for a file the current one lists. What ``collect`` with 2 kept
    generations must delete and keep."""
    make_dataset(directory, inputs=(9, 9, 9, 9, 9))
    files = {}
    for name in ("input-0.tar", "input-1.tar", "input-2.tar", "input-3.tar"):
        files[name] = {p for e in load_manifest(directory).shards if e.input == name for p in (e.path, e.meta_path)}
    retire_input(directory, "input-1.tar")
    retire_input(directory, "input-2.tar")
    manifest = load_manifest(directory)
    manifest.inputs.pop("input-3.tar")
    manifest.shards = [e for e in manifest.shards if e.input != "input-3.tar"]
    live = sorted(files["input-0.tar"])[0]
    manifest.retired += [RetiredFile(p, 1, "2000-01-01T00:00:00+00:00") for p in sorted(files["input-3.tar"]) + [live]]
    assert write_manifest(directory, manifest) == 4
    if corrupt_kept:
        with open(generation_path(directory, 3), "r+b") as f:
            f.truncate(50)
    doomed = files["input-1.tar"] | files["input-2.tar"]
    if corrupt_kept:
        return {"deleted": doomed | files["input-3.tar"], "kept": {live}}
    return {"deleted": doomed, "kept": files["input-3.tar"] | {live}}


@pytest.mark.parametrize("layout", ["index", "corrupt-kept-generation", "legacy"])
def test_collect_deletes_and_keeps_the_same_files_given_the_manifest_or_the_index(tmp_path, layout):
    out = str(tmp_path / "ds")
    expected = _collect_history(out, corrupt_kept=layout == "corrupt-kept-generation")
    if layout == "legacy":  # older generations gone: only the current one protects
        as_legacy(out)
        current = {p for e in load_manifest(out).shards for p in (e.path, e.meta_path)}
        expected = {"deleted": expected["deleted"] | expected["kept"] - current, "kept": expected["kept"] & current}
    by_manifest, by_index = copies(out, tmp_path)
    before = shard_files(out)
    later = datetime.now(timezone.utc) + timedelta(hours=1)
    policy = retention.Retention(hours=0, generations=2, passing_minutes=0)
    with dataset_dir.writing(by_manifest):
        from_manifest = retention.collect(by_manifest, load_manifest(by_manifest), policy, later)
    with dataset_dir.writing(by_index):
        from_index = retention.collect(by_index, load_index(by_index), policy, later)
    assert set(from_manifest.files) == set(from_index.files) == expected["deleted"]
    assert from_manifest.retained_files == from_index.retained_files
    assert from_manifest.generations == from_index.generations
    assert shard_files(by_manifest) == shard_files(by_index) == before - expected["deleted"]
    assert expected["kept"] <= shard_files(by_index)


def test_gc_over_the_index_makes_no_shard_entry(tmp_path, monkeypatch):
    out = str(tmp_path / "ds")
    _history(out, 15)
    expected = shard_files(out) & protected(out)
    retired = {r.path for r in load_manifest(out).retired}

    def refuse(self, *args, **kwargs):
        raise AssertionError("a ShardEntry was made")

    monkeypatch.setattr(ShardEntry, "__init__", refuse)
    with pytest.raises(AssertionError, match="ShardEntry was made"):
        load_manifest(out)
    later = datetime.now(timezone.utc) + timedelta(days=30)
    collected = retention.gc(out, retention.Retention(hours=0, generations=1, passing_minutes=0), now=later)
    index = load_index(out)
    with dataset_dir.writing(out):
        dataset_dir.clean_leftovers(out, index)
        retention.collect(out, index, retention.Retention(), later)
    monkeypatch.undo()
    assert set(collected.files) == retired  # past retention, and listed by no kept generation
    assert shard_files(out) == expected - retired


def test_equal_strings_hash_equal_at_any_fixed_width_and_as_text():
    values = ["", "a", "shards/in-0000-v0-00000.npy", "shards/fötö-日本-00001.jsonl", "x" * 300, "ab", "ba"]
    reference = [_fnv1a(v.encode()) for v in values]
    assert string_hashes(values).tolist() == reference
    encoded = [v.encode() for v in values]
    for width in (300, 301, 512):
        assert string_hashes(np.array(encoded, dtype=f"S{width}")).tolist() == reference
    short = encoded[:4] + encoded[5:]  # without "x" * 300: a narrower array, its width the longest value's
    narrow = np.array(short)
    assert narrow.dtype.itemsize == len(encoded[3]) < 300
    assert string_hashes(narrow).tolist() == string_hashes(narrow.astype("S400")).tolist() == [
        _fnv1a(v) for v in short]
    assert string_hashes([]).dtype == np.uint64 and len(string_hashes(np.zeros(0, "S5"))) == 0
    assert string_hashes(["\udcff"]).tolist() == [_fnv1a(b"\xff")]  # a name os.listdir could not decode


def test_membership_is_a_lookup_in_sorted_hashes():
    listed = np.unique(string_hashes([f"shards/{i}.npy" for i in range(1000)]))
    asked = string_hashes(["shards/5.npy", "shards/1000.npy", "shards/999.npy", ""])
    assert hashes_in(listed, asked).tolist() == [True, False, True, False]
    assert hashes_in(np.zeros(0, np.uint64), asked).tolist() == [False] * 4


def test_the_index_hashes_exactly_the_paths_the_manifest_lists(history):
    index, manifest = load_index(history), load_manifest(history)
    paths = [p for e in manifest.shards for p in (e.path, e.meta_path)]
    assert index.shards.path_hashes().tolist() == np.unique(string_hashes(paths)).tolist()
    assert dataset_dir.listed_hashes(manifest).tolist() == dataset_dir.listed_hashes(index).tolist()


def test_a_local_folder_is_read_as_its_files_names_in_chunks(tmp_path):
    store = LocalStorage()
    folder = str(tmp_path / "f")
    names = {f"n-{i}-ü.npy" for i in range(300)}
    os.makedirs(folder)
    for name in names:
        open(os.path.join(folder, name), "wb").close()
    os.makedirs(os.path.join(folder, "sub"))
    assert sorted(store.iter_dir(folder)) == sorted(names)
    assert list(store.iter_dir(str(tmp_path / "missing"))) == []


def test_clean_leftovers_on_object_storage_reads_shards_a_page_at_a_time(s3_bucket, monkeypatch):
    out = f"s3://{s3_bucket}/ds"
    run_steps(out, 6)
    store = for_path(out)
    listed = {p for e in load_manifest(out).shards for p in (e.path, e.meta_path)}
    strays = [f"shards/stray-{i:05d}.npy" for i in range(1001)]  # more than one LIST page
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda rel: store.publish(store.join(out, rel), b""), sorted(listed) + strays))
    store.publish(store.join(out, "shards/nested/kept.npy"), b"")  # not directly in shards/: not a name
    assert sorted(store.iter_dir(store.join(out, "shards"))) == sorted(p.split("/")[1] for p in listed | set(strays))
    monkeypatch.setattr(cleaning, "_LISTING_CHUNK", 100)
    with dataset_dir.writing(out):
        assert dataset_dir.clean_leftovers(out, load_index(out)).removed == len(strays)
    assert set(store.list_dir(store.join(out, "shards"))) == {p.split("/")[1] for p in listed} | {"nested"}
    assert list(store.iter_dir(f"s3://{s3_bucket}/nothing-here")) == []


def test_a_runs_cleaning_compares_every_file_only_after_a_run_that_left_its_mark(tmp_path):
    # Without a mark, a run's cleaning does not read shards/ (no run was killed since the last cleaning,
    # so nothing there is a leftover: on object storage that listing is a LIST of every shard); a mark
    # left by a killed run makes it compare every file in shards/ with the index, once; gc always does,
    # and takes the marks.
    out = str(tmp_path / "ds")
    make_dataset(out, (3, 2))  # real shard files, listed
    shards = os.path.join(out, "shards")
    stray, temp = os.path.join(shards, "stray-00000.npy"), os.path.join(shards, ".tmp-upload")
    for path in (stray, temp):
        open(path, "wb").close()
    listed = set(os.listdir(shards)) - {"stray-00000.npy", ".tmp-upload"}
    with dataset_dir.writing(out):
        assert dataset_dir.unfinished_runs(out) == []
        dataset_dir.clean_after_runs(out, load_index(out))
        assert os.path.exists(stray) and os.path.exists(temp)  # shards/ is not even read
        dataset_dir.mark_run(out, "killed-run")
        assert dataset_dir.unfinished_runs(out) == ["killed-run"]
        dataset_dir.clean_after_runs(out, load_index(out))
        assert not os.path.exists(stray) and not os.path.exists(temp) and dataset_dir.unfinished_runs(out) == []
    assert set(os.listdir(shards)) == listed  # nothing listed went
    open(stray, "wb").close()
    with dataset_dir.writing(out):
        dataset_dir.mark_run(out, "another")
    retention.gc(out, retention.Retention())
    assert not os.path.exists(stray) and dataset_dir.unfinished_runs(out) == []
    assert set(os.listdir(shards)) == listed
