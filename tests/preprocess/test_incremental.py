"""Reruns over nightly drops: only new or changed inputs are processed, and the result is byte for byte
what one run over everything gives; a changed input's shards are replaced, a vanished one's kept; a bucketed
dataset's rerun processes only the new input and counts its samples per bucket, and refuses another bucket list."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from typer.testing import CliRunner

import shardio
from preprocess.cli import app
from preprocess.image.buckets import nearest_bucket
from tests.dataset_compare import assert_clean, assert_indices, assert_same_dataset, dataset_state
from tests.bucket_jobs import (BUCKET_FLAGS, JOB_BUCKETS, SOURCE_SIZES, check_buckets, make_bucket_tars,
                               run_bucket_job)
from tests.legacy_format import legacy_doc
from tests.paths import REPO_ROOT
from tests.tar_factory import Member, index_image, jpeg_bytes

pytestmark = pytest.mark.ray
runner = CliRunner()

# Awkward sizes against shards of 8: partial last shards, a one-sample tar.
DROPS = [[13, 8, 1], [17, 5], [9, 3]]
DEFAULT_YAML = os.path.join(REPO_ROOT, "configs", "default.yaml")


def run_cli(*args: str):
    return runner.invoke(app, ["run", *args, "--size", "16", "--samples-per-shard", "8"], catch_exceptions=False)


def test_three_drops_give_the_same_bytes_as_one_run_and_a_noop_rerun_says_so(ray_cluster, tars, tmp_path):
    dropped, single = str(tmp_path / "dropped"), str(tmp_path / "single")
    pattern = f"{tars.directory}/*.tar"
    start = 0
    for number, sizes in enumerate(DROPS):
        for size in sizes:
            tars.make(f"part-{len(tars.made):03d}.tar", range(start, start + size))
            start += size
        result = run_cli(pattern, "--output", dropped, "-q", "--report", str(tmp_path / f"drop{number}.json"))
        assert result.exit_code == 0, result.output
        report = json.load(open(tmp_path / f"drop{number}.json"))
        assert len(report["inputs_processed"]) == len(sizes), "a committed input was processed again"
        assert len(report["inputs_skipped"]) == sum(len(d) for d in DROPS[:number])
    assert run_cli(pattern, "--output", single, "-q").exit_code == 0
    assert_same_dataset(dropped, single)
    assert_clean(dropped)
    assert_indices(dropped, list(range(start)))

    manifest_bytes = open(os.path.join(dropped, "manifest.json"), "rb").read()
    noop = run_cli(pattern, "--output", dropped)
    assert noop.exit_code == 0, noop.output
    assert "0 input(s) to process" in noop.output and "nothing new to process" in noop.output
    assert open(os.path.join(dropped, "manifest.json"), "rb").read() == manifest_bytes, "a no-op rewrote the manifest"
    # Every run's report is kept: three drops and the no-op.
    assert len(os.listdir(os.path.join(dropped, "reports"))) == 4


def test_changed_input_is_replaced_and_vanished_input_kept_unless_prune(ray_cluster, tars, tmp_path):
    a = tars.make("a.tar", range(0, 10))
    b = tars.make("b.tar", range(10, 14))
    out = str(tmp_path / "out")
    assert run_cli(f"{tars.directory}/*.tar", "--output", out, "-q").exit_code == 0
    old_a = dataset_state(out)["inputs"][a]["shards"]

    tars.make("a.tar", range(20, 23))  # same path, new content
    os.utime(a, ns=(1_800_000_000_000_000_000, 1_800_000_000_000_000_000))  # a sure mtime change
    os.remove(b)
    # No retention (superseded files are kept for readers by default: tests/write/test_generations.py).
    no_retention = ("--retain-hours", "0", "--retain-generations", "1")
    assert run_cli(a, "--output", out, "-q", *no_retention).exit_code == 0
    state = dataset_state(out)
    assert not set(old_a) & set(state["inputs"][a]["shards"]), "a changed input must get new shard names"
    assert b in state["inputs"], "an input that disappeared keeps its shards without --prune"
    assert_clean(out)  # the old shards of a.tar are deleted, not just unlisted
    assert_indices(out, [20, 21, 22, 10, 11, 12, 13])

    # b.tar holds 4 of the 7 samples: a prune of most of the dataset must be confirmed.
    assert run_cli(a, "--output", out, "-q", "--prune", "--confirm-large-prune", *no_retention).exit_code == 0
    assert b not in dataset_state(out)["inputs"]
    assert_clean(out)
    assert_indices(out, [20, 21, 22])


def test_a_reader_keeps_the_snapshot_it_opened_while_a_run_appends(ray_cluster, tars, tmp_path):
    tars.make("a.tar", range(0, 9))
    out = str(tmp_path / "out")
    assert run_cli(tars.made[0], "--output", out, "-q").exit_code == 0
    before = shardio.open_dataset(out)
    first_pixels = before.pixels(0).copy()
    tars.make("b.tar", range(9, 20))
    assert run_cli(f"{tars.directory}/*.tar", "--output", out, "-q").exit_code == 0
    assert len(before) == 9 and len(before.shards) == 2, "the open snapshot changed under the reader"
    assert (before.pixels(0) == first_pixels).all() and before.pixels(1).shape[0] == 1
    assert len(shardio.open_dataset(out)) == 20


@pytest.mark.parametrize(
    "flags, field",
    [
        (["--size", "24"], "height"),
        (["--mode", "pad"], "mode"),
        (["--resample", "bilinear"], "resample"),
        (["--samples-per-shard", "4"], "samples_per_shard"),
    ],
)
def test_a_different_config_is_refused_and_the_dataset_untouched(tars, tmp_path, flags, field):
    from preprocess.config import JobConfig
    from shardio.format import Manifest
    from shardio.write.shard_writer import write_manifest

    # An existing (empty) dataset written with --size 16 --samples-per-shard 8: the refusal comes before Ray.
    out = str(tmp_path / "out")
    os.makedirs(out)
    config = JobConfig(height=16, width=16, samples_per_shard=8)
    write_manifest(out, Manifest(shape=(16, 16, 3), config=config.output_dict(), versions={}))
    before = open(os.path.join(out, "manifest.json"), "rb").read()
    tars.make("a.tar", range(2))
    args = ["run", tars.made[0], "--output", out, "--size", "16", "--samples-per-shard", "8", *flags]
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    message = " ".join(result.output.split())  # rich wraps long paths
    assert "different config" in message and f"{field}:" in message
    assert open(os.path.join(out, "manifest.json"), "rb").read() == before
    shutil.rmtree(out)


def test_a_rerun_without_flags_uses_the_datasets_config_and_a_disagreeing_key_is_refused(ray_cluster, tars, tmp_path):
    out = str(tmp_path / "out")
    tars.make("a.tar", range(0, 5))
    first = runner.invoke(app, ["run", f"{tars.directory}/*.tar", "--output", out, "--size", "16",
                                "--samples-per-shard", "4", "--resample", "box", "-q"])
    assert first.exit_code == 0, first.output
    tars.make("b.tar", range(5, 11))
    # The nightly rerun names no flag: the dataset's own config (16x16, 4 per shard, box), not the defaults.
    again = runner.invoke(app, ["run", f"{tars.directory}/*.tar", "--output", out, "-q"])
    assert again.exit_code == 0, again.output
    manifest = legacy_doc(out)
    assert manifest["shape"] == [16, 16, 3] and manifest["config"]["resample"] == "box"
    assert [s["samples"] for s in manifest["shards"]] == [4, 1, 4, 2]
    assert_indices(out, list(range(11)))
    # Run policy may differ from run to run; it is not the dataset's config.
    policy = tmp_path / "policy.yaml"
    policy.write_text("max_decode_seconds: 5\nmax_failed_fraction: 0.5\n")
    assert runner.invoke(app, ["run", f"{tars.directory}/*.tar", "--output", out, "-c", str(policy)]).exit_code == 0
    before = dataset_state(out)
    # A flag, or a config file, that disagrees with the dataset is still refused, naming each key.
    flag = runner.invoke(app, ["run", f"{tars.directory}/*.tar", "--output", out, "--samples-per-shard", "8"])
    said = " ".join(flag.output.split())
    assert flag.exit_code == 2 and "samples_per_shard: dataset has 4, this run 8" in said, flag.output
    assert "height" not in said, "a key the command did not name is reported as differing"
    from_file = runner.invoke(app, ["run", f"{tars.directory}/*.tar", "--output", out, "-c", DEFAULT_YAML])
    said = " ".join(from_file.output.split())
    assert from_file.exit_code == 2, from_file.output
    for key in ("height: dataset has 16, this run 256", "width:", "samples_per_shard:", "resample:"):
        assert key in said, said
    assert dataset_state(out) == before


# --- mode: bucket --------------------------------------------------------------------------------------------------

def test_an_incremental_run_processes_only_the_new_input(ray_cluster, tars, tmp_path) -> None:
    pattern, samples = make_bucket_tars(tars, [11, 9])
    out, report = str(tmp_path / "out"), str(tmp_path / "report.json")
    assert run_bucket_job(pattern, "--output", out).exit_code == 0
    before = dataset_state(out)
    tars.write("02.tar", [Member(f"{i:06d}.jpg", jpeg_bytes(index_image(i, *SOURCE_SIZES[i % len(SOURCE_SIZES)])))
                          for i in range(samples, samples + 7)])
    result = runner.invoke(app, ["run", pattern, "--output", out, *BUCKET_FLAGS, "--report", report],
                           catch_exceptions=False)
    assert result.exit_code == 0, result.output
    said = " ".join(result.output.split())
    counts: dict[str, int] = {}
    for index in range(samples, samples + 7):
        h, w = JOB_BUCKETS[nearest_bucket(*SOURCE_SIZES[index % len(SOURCE_SIZES)], JOB_BUCKETS)]
        counts[f"{h}x{w}"] = counts.get(f"{h}x{w}", 0) + 1
    expected = ", ".join(f"{h}x{w} {counts[f'{h}x{w}']}" for h, w in JOB_BUCKETS if f"{h}x{w}" in counts)
    assert f"samples written per bucket (h x w, as `shardio info`): {expected}" in said
    with open(report, encoding="utf-8") as f:
        doc = json.load(f)
    assert doc["inputs_skipped_count"] == 2 and len(doc["inputs_processed"]) == 1
    assert doc["samples_per_bucket"] == {f"{h}x{w}": counts[f"{h}x{w}"] for h, w in JOB_BUCKETS if f"{h}x{w}" in counts}
    check_buckets(out, samples + 7)
    after = dataset_state(out)
    assert {k: v for k, v in after["files"].items() if k in before["files"]} == before["files"]


def test_another_bucket_list_is_refused(ray_cluster, tars, tmp_path) -> None:
    pattern, _ = make_bucket_tars(tars, [5])
    out = str(tmp_path / "out")
    assert run_bucket_job(pattern, "--output", out).exit_code == 0
    config = tmp_path / "other.yaml"
    config.write_text("buckets: [[32, 32], [24, 40], [40, 24]]\n")
    result = runner.invoke(app, ["run", pattern, "--output", out, "--config", str(config), "-q"])
    assert result.exit_code == 2, result.output
    assert "buckets: dataset has" in " ".join(result.output.split())
