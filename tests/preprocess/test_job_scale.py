"""The job at scale, with small numbers: a no-op rerun over 2,000 committed inputs does no per-input I/O
(counted through spies, not timed), and its run report does not grow with the inputs it skips.

The curve itself (300 / 3k / 30k inputs, wall time and RSS) is ``python -m bench.scale_job``.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections import Counter

import pytest

from bench.scale_job import CONFIG, make_committed_inputs
from preprocess.inputs.resolve import resolve_inputs
from preprocess.job import RunOptions, run_job
from preprocess.plan import check_output_apart, plan_inputs
from shardio.errors import DatasetIncompatibleError, OutputUnusable
from shardio.format import InputEntry
from shardio.format.run_report import NAMED_SKIPPED, skipped_count
from shardio.store import backends
from shardio.write.directory import report_path

_AUDIT: dict[str, Counter] = {}


def _audit(event: str, args: tuple) -> None:
    counter = _AUDIT.get("events")
    if counter is None:
        return
    if event == "open" and isinstance(args[0], (str, bytes)) and str(args[0]).endswith(".tar"):
        counter["open .tar"] += 1
    elif event in ("os.scandir", "os.listdir"):
        counter[event] += 1


sys.addaudithook(_audit)  # an audit hook cannot be removed: it counts only while a test arms it


@pytest.fixture
def io_counts(monkeypatch):
    """Counts of tar opens (audit events), folder listings, and ``os.stat`` / ``os.lstat`` calls made from
    Python (``os.path.isfile``, ``realpath``, ``exists`` all go through them); ``DirEntry.stat`` is the
    listing's own stat and is not counted."""
    counts: Counter = Counter()
    for name in ("stat", "lstat"):
        real = getattr(os, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            counts[f"os.{_name}"] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(os, name, counted)
    _AUDIT["events"] = counts
    yield counts
    _AUDIT.pop("events", None)


def test_a_noop_rerun_over_2000_committed_inputs_opens_and_stats_no_input(tmp_path, io_counts):
    pattern, dataset = make_committed_inputs(str(tmp_path / "big"), 2000)
    io_counts.clear()
    report = run_job(RunOptions([pattern], dataset, CONFIG))
    assert report.inputs_processed == [] and report.inputs_failed == [] and report.exit_code == 0
    assert report.inputs_skipped_count == 2000
    assert io_counts["open .tar"] == 0, io_counts
    # Constant, not per input: the lock, the manifest, its generations, the report (the old plan was 2,000
    # stats for isfile, 2,000 for the fingerprint and ~10,000 lstats for realpath).
    assert io_counts["os.stat"] + io_counts["os.lstat"] < 100, io_counts
    assert io_counts["os.scandir"] + io_counts["os.listdir"] < 20, io_counts


def test_a_noop_rerun_is_answered_from_the_index_columns_without_an_object_per_shard(tmp_path, monkeypatch):
    pattern, dataset = make_committed_inputs(str(tmp_path / "big"), 300)
    before = run_job(RunOptions([pattern], dataset, CONFIG))  # the full path's answer, for comparison
    shards = os.path.join(dataset, "shards")
    open(os.path.join(shards, ".tmp-killed-upload"), "wb").close()  # a killed run's temp file
    stray = os.path.join(shards, "not-listed-00000.npy")
    open(stray, "wb").close()  # a promoted file no input lists (a run's name for a shard)
    foreign = os.path.join(shards, "my_notes.txt")
    open(foreign, "w").write("mine")  # no run writes such a name: kept and named, never deleted
    open(os.path.join(dataset, ".run-killed.json"), "w").write('{"run": "killed"}')  # the killed run's mark

    def no_objects(*args, **kwargs):
        raise AssertionError("a no-op rerun built the manifest's objects")

    monkeypatch.setattr("shardio.format.manifests.manifest_from_root", no_objects)
    monkeypatch.setattr("shardio.format.manifests.Manifest.from_json", no_objects)
    report = run_job(RunOptions([pattern], dataset, CONFIG))
    assert (report.inputs_skipped_count, report.inputs_skipped, report.exit_code) == (
        before.inputs_skipped_count, before.inputs_skipped, 0)
    assert (report.dataset_samples, report.generation) == (before.dataset_samples, before.generation)
    # The killed run's leftovers went (every file compared with the index's columns), and its mark.
    assert not os.path.exists(os.path.join(shards, ".tmp-killed-upload")) and not os.path.exists(stray)
    assert open(foreign).read() == "mine" and any("my_notes.txt" in w for w in report.warnings), report.warnings
    assert not os.path.exists(os.path.join(dataset, ".run-killed.json"))
    assert os.path.exists(report_path(dataset, report.run_id))
    monkeypatch.undo()
    with pytest.raises(DatasetIncompatibleError, match="different config"):  # checked on this path too
        run_job(RunOptions([pattern], dataset, dataclasses.replace(CONFIG, height=CONFIG.height + 1)))


def test_the_run_report_names_a_bounded_number_of_skipped_inputs(tmp_path):
    sizes = {}
    for count in (150, 1500):
        pattern, dataset = make_committed_inputs(str(tmp_path / str(count)), count)
        report = run_job(RunOptions([pattern], dataset, CONFIG))
        assert report.inputs_skipped_count == count
        assert report.inputs_skipped == sorted(report.inputs_skipped) and len(report.inputs_skipped) == NAMED_SKIPPED
        assert report.inputs_skipped[0].endswith("000000.tar")
        sizes[count] = os.path.getsize(report_path(dataset, report.run_id))
    # Ten times the inputs: the same report, but for the digits of its counts and paths.
    assert abs(sizes[1500] - sizes[150]) < 500, sizes


def test_skipped_count_reads_both_report_versions():
    assert skipped_count({"inputs_skipped": ["a.tar", "b.tar"]}) == 2  # version 1: every name
    assert skipped_count({"report_version": 2, "inputs_skipped": ["a.tar"], "inputs_skipped_count": 230_000}) == 230_000
    assert skipped_count({}) == 0


def test_the_plan_compares_fingerprints_and_orders_the_work_largest_first(tars):
    small, big, same, changed = (tars.make(name, range(n)) for name, n in
                                 (("a.tar", 1), ("b.tar", 4), ("c.tar", 2), ("d.tar", 2)))
    resolved = resolve_inputs([f"{tars.directory}/*.tar"])
    info = {path: os.stat(path) for path in resolved.paths}
    committed = {same: InputEntry(info[same].st_size, info[same].st_mtime_ns, 2, 0),
                 changed: InputEntry(info[changed].st_size, info[changed].st_mtime_ns + 1, 2, 0)}
    plan = plan_inputs(resolved, committed)
    assert plan.skipped == 1 and plan.skipped_named == [same]
    assert [path for path, _ in plan.todo] == sorted([small, big, changed], key=lambda p: (-info[p].st_size, p))
    assert all(fp == (info[p].st_size, info[p].st_mtime_ns, "") for p, fp in plan.todo)


@pytest.mark.parametrize("link", ["a tar", "the input folder"])
def test_an_input_that_links_into_the_output_is_refused(tars, tmp_path, link):
    out = tmp_path / "out"
    out.mkdir()
    (out / "inside.tar").write_bytes(b"")
    elsewhere = tmp_path / "elsewhere"
    if link == "a tar":
        elsewhere.mkdir()
        os.symlink(out / "inside.tar", elsewhere / "x.tar")
    else:
        os.symlink(out, elsewhere)
    resolved = resolve_inputs([f"{elsewhere}/*.tar"])
    with pytest.raises(OutputUnusable, match="--output holds input"):
        check_output_apart(str(out), resolved)
    check_output_apart(str(tmp_path / "other-out"), resolved)  # apart: fine


@pytest.mark.ray
def test_a_run_with_work_makes_objects_only_for_the_inputs_it_adds(ray_cluster, tmp_path, monkeypatch):
    # What a run loads is the index as columns: a shard entry object only for the shards it adds (here 2
    # inputs of 5 samples), whatever the dataset already holds (300 committed inputs), leftovers included.
    from shardio.format import ShardEntry
    from shardio.format.manifests import load_manifest
    from tests.tar_factory import TarFactory

    pattern, dataset = make_committed_inputs(str(tmp_path / "big"), 300)
    factory = TarFactory(os.path.dirname(pattern))
    factory.make("new-a.tar", range(3), size=(16, 12))
    factory.make("new-b.tar", range(3, 5), size=(16, 12))
    stray = os.path.join(dataset, "shards", "killed-run-00000.npy")
    open(stray, "wb").close()  # a killed run's promoted file that no commit lists
    mark = os.path.join(dataset, ".run-20261101T000000Z-abcdef.json")
    open(mark, "w").write('{"run": "20261101T000000Z-abcdef"}')  # the mark the killed run left
    made: Counter = Counter()
    real_init = ShardEntry.__init__

    def counted(self, *args, **kwargs):
        made["shard entries"] += 1
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(ShardEntry, "__init__", counted)
    report = run_job(RunOptions([pattern], dataset, CONFIG, ray_address=ray_cluster))
    monkeypatch.undo()
    assert sorted(os.path.basename(p) for p in report.inputs_processed) == ["new-a.tar", "new-b.tar"]
    assert report.inputs_skipped_count == 300 and report.exit_code == 0 and report.dataset_samples == 305
    assert made["shard entries"] <= 2 * 4, made  # the new inputs' shards (and a copy each at most)
    assert not os.path.exists(stray) and not os.path.exists(mark)  # the pass over every file ran, once
    assert not [n for n in os.listdir(dataset) if n.startswith(".run-")]  # this run ended: no mark of its own
    manifest = load_manifest(dataset)
    assert len(manifest.inputs) == 302 and manifest.samples == 305
    assert all(os.path.exists(os.path.join(dataset, e.path)) for e in manifest.shards)


def test_a_run_chooses_its_outputs_backend_once_whatever_it_holds(tmp_path, monkeypatch):
    asked: dict[int, list[str]] = {}
    for count in (150, 1500):
        pattern, dataset = make_committed_inputs(str(tmp_path / str(count)), count)
        calls: list[str] = []
        scheme = backends.scheme
        with monkeypatch.context() as patch:
            patch.setattr(backends, "scheme", lambda path, _calls=calls: _calls.append(path) or scheme(path))
            report = run_job(RunOptions([pattern], dataset, CONFIG))
        assert report.inputs_skipped_count == count
        assert [path for path in calls if path.startswith(dataset)] == [dataset]  # the output: opened once
        asked[count] = calls
    assert len(asked[150]) == len(asked[1500]), asked  # and the inputs' backend per pattern, not per input
