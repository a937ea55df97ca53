"""Generations and retention through ``preprocess`` (issue 11, items 2, 5, 6): a reader of the previous
snapshot survives a run that replaces and prunes inputs, and can reopen it; ``gc`` collects only once
retention allows; a forged shard path deletes nothing outside the dataset; a corrupt manifest.json is
restored from a kept generation by ``verify --repair`` and by the next run, losing no committed input."""

from __future__ import annotations

import json
import os
from datetime import datetime, timedelta, timezone

import pytest
from typer.testing import CliRunner

import shardio
from preprocess.cli import app
from shardio.write.retention import Retention
from shardio.write.retention import gc as gc_dataset
from shardio.errors import ShardFormatError
from shardio.format.manifests import list_generations
from tests.dataset_compare import assert_clean, assert_indices, dataset_state
from tests.legacy_format import as_legacy
from tests.tar_factory import decode_index

pytestmark = pytest.mark.ray
runner = CliRunner()
FLAGS = ["--size", "16", "--samples-per-shard", "4", "-q"]


def run_cli(*args: str):
    return runner.invoke(app, ["run", *args, *FLAGS], catch_exceptions=False)


def snapshot_indices(snapshot) -> list[int]:
    """Every sample of an open snapshot, read now (lazily memory-mapped, as an epoch reads them)."""
    found = []
    for shard in range(len(snapshot.shards)):
        keys = snapshot.meta(shard).keys
        pixels = [decode_index(p) for p in snapshot.pixels(shard)]
        assert keys == [f"{i:06d}" for i in pixels], "metadata and pixels disagree"
        found += pixels
    return found


def test_a_reader_of_the_previous_generation_survives_replace_and_prune_and_can_reopen_it(ray_cluster, tars,
                                                                                          tmp_path):
    a = tars.make("a.tar", range(0, 10))
    tars.make("b.tar", range(10, 14))
    out = str(tmp_path / "out")
    assert run_cli(f"{tars.directory}/*.tar", "--output", out).exit_code == 0
    before = shardio.open_dataset(out)  # a trainer's epoch starts; no shard is mapped yet
    generation = before.generation

    tars.make("a.tar", range(20, 23))  # a.tar changes: its shards are replaced
    os.utime(a, ns=(1_800_000_000_000_000_000,) * 2)
    result = runner.invoke(app, ["run", a, "--output", out, "--prune", *FLAGS, "--report", str(tmp_path / "r.json")])
    assert result.exit_code == 0, result.output
    report = json.load(open(tmp_path / "r.json"))
    assert report["generation"] > generation and report["files_collected"] == []

    # The old snapshot reads to the end (it raised FileNotFoundError when superseded files were deleted
    # at commit), and reopening its generation gives the same samples: a resumed epoch.
    assert snapshot_indices(before) == list(range(14))
    assert snapshot_indices(shardio.open_dataset(out, generation=generation)) == list(range(14))
    resumed = shardio.ShardDataset(out, batch_size=4, generation=generation)
    assert resumed.snapshot.generation == generation and len(resumed.snapshot) == 14
    assert_indices(out, [20, 21, 22])
    manifest = json.load(open(os.path.join(out, "manifest.json")))
    assert manifest["generation"] == report["generation"]
    assert len(manifest["retired"]) == 2 * len(before.shards)
    assert all(generation < r["generation"] <= report["generation"] for r in manifest["retired"])

    # gc with the default retention, or a 1-generation one within 24 h: nothing goes.
    for flags in ([], ["--retain-generations", "1"]):
        kept = runner.invoke(app, ["gc", out, *flags])
        assert kept.exit_code == 0, kept.output
        assert "collected 0 retired file(s)" in kept.output
    assert snapshot_indices(shardio.open_dataset(out, generation=generation)) == list(range(14))

    # A day later, one generation kept: the superseded files and generation files go, the dataset stays.
    collected = gc_dataset(out, Retention(hours=24, generations=1),
                           now=datetime.now(timezone.utc) + timedelta(hours=25))
    assert len(collected.files) == 2 * len(before.shards) and generation in collected.generations
    assert list_generations(out) == [report["generation"]]
    assert_clean(out)
    assert_indices(out, [20, 21, 22])
    with pytest.raises(ShardFormatError, match=f"generation {generation} is not kept"):
        shardio.open_dataset(out, generation=generation)


def forge_shard_path(out: str, victim: str) -> None:
    """Point manifest.json's first shard at a file outside the dataset (an edited or forged manifest)."""
    as_legacy(out)  # the one-document layout of format 1/2, which a hand edit can forge
    path = os.path.join(out, "manifest.json")
    doc = json.load(open(path))
    real, forged = doc["shards"][0]["path"], os.path.relpath(victim, out)  # "../victim.npy"
    doc["shards"][0]["path"] = forged
    for entry in doc["inputs"].values():
        entry["shards"] = [forged if s == real else s for s in entry["shards"]]
    json.dump(doc, open(path, "w"))


def test_a_forged_shard_path_never_deletes_outside_the_dataset(ray_cluster, tars, tmp_path):
    a = tars.make("a.tar", range(0, 10))
    tars.make("b.tar", range(10, 14))
    out = str(tmp_path / "out")
    assert run_cli(f"{tars.directory}/*.tar", "--output", out).exit_code == 0
    victim = str(tmp_path / "victim.npy")
    open(victim, "wb").write(b"precious")

    forge_shard_path(out, victim)
    checked = runner.invoke(app, ["verify", out])
    assert checked.exit_code == 1 and "unsafe shard path" in " ".join(checked.output.split())
    repaired = runner.invoke(app, ["verify", out, "--repair"])
    assert repaired.exit_code == 0, repaired.output
    assert "RESTORED manifest.json from kept generation" in repaired.output
    assert open(victim, "rb").read() == b"precious"

    forge_shard_path(out, victim)
    result = runner.invoke(app, ["run", a, "--output", out, "--prune", "--retain-hours", "0",
                                 "--retain-generations", "1", *FLAGS[:-1]])
    assert result.exit_code == 0, result.output
    assert "restored from kept generation" in " ".join(result.output.split())
    assert open(victim, "rb").read() == b"precious"
    assert_clean(out)
    assert_indices(out, list(range(10)))


def test_a_corrupt_manifest_is_restored_by_verify_repair_and_by_the_next_run(ray_cluster, tars, tmp_path):
    tars.make("a.tar", range(0, 6))
    tars.make("b.tar", range(6, 9))
    out = str(tmp_path / "out")
    assert run_cli(f"{tars.directory}/*.tar", "--output", out).exit_code == 0
    good = dataset_state(out)
    path = os.path.join(out, "manifest.json")
    data = open(path, "rb").read()
    committed = json.loads(data)["generation"]  # 1 or 2: the run commits as inputs finish

    open(path, "wb").write(data[:100])
    checked = runner.invoke(app, ["verify", out])
    message = " ".join(checked.output.split())
    assert checked.exit_code == 1 and "kept generations: " in message and "--repair" in message
    assert f"{committed}: `preprocess verify" in message
    repaired = runner.invoke(app, ["verify", out, "--repair"])
    assert repaired.exit_code == 0, repaired.output
    assert "RESTORED" in repaired.output and "all match the manifest" in repaired.output
    assert dataset_state(out) == good

    # The next run restores too, and skips every committed input instead of rebuilding from nothing.
    open(path, "wb").write(data[:100])
    tars.make("c.tar", range(9, 11))
    report = str(tmp_path / "r.json")
    result = run_cli(f"{tars.directory}/*.tar", "--output", out, "--report", report)
    assert result.exit_code == 0, result.output
    doc = json.load(open(report))
    assert sorted(map(os.path.basename, doc["inputs_skipped"])) == ["a.tar", "b.tar"]
    assert [os.path.basename(p) for p in doc["inputs_processed"]] == ["c.tar"]
    assert any(f"restored from kept generation {committed}" in w for w in doc["warnings"]), doc["warnings"]
    assert_clean(out)
    assert_indices(out, list(range(11)))
