"""``mode: bucket`` end to end through the job (Ray): every sample once, in a shard of its bucket's shape;
an incremental rerun skips; a rerun after kill -9 gives the same bytes; raw and JPEG."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import numpy as np
import pytest
from typer.testing import CliRunner

import shardio
from preprocess.image.buckets import nearest_bucket
from preprocess.cli import app
from preprocess.config import JobConfig
from tests.bucket_fixtures import swap_shard_buckets
from tests.dataset_compare import assert_clean, assert_same_dataset, dataset_state
from tests.dataset_fixtures import flip_bits
from tests.preprocess.test_crash_safety import wait_for_dead_runs_tasks, watch
from tests.tar_factory import Member, decode_index, index_image, jpeg_bytes

pytestmark = pytest.mark.ray
runner = CliRunner()
# A 32x32 budget, sides multiples of 8: 16x48, 24x40, 32x32, 40x24, 48x16 (h x w).
FLAGS = ["--size", "32", "--mode", "bucket", "--bucket-step", "8", "--samples-per-shard", "4"]
BUCKETS = JobConfig(height=32, width=32, mode="bucket", bucket_step=8).buckets
# Source sizes (w, h): square, 3:2, 2:3, 8:3, 3:8, 5:4; flat colours: the centre pixel says the sample.
SIZES = [(96, 96), (120, 80), (80, 120), (128, 48), (48, 128), (100, 80)]


def make_tars(tars, counts: list[int]) -> tuple[str, int]:
    start = 0
    for number, count in enumerate(counts):
        members = []
        for index in range(start, start + count):
            width, height = SIZES[index % len(SIZES)]
            members += [Member(f"{index:06d}.jpg", jpeg_bytes(index_image(index, width, height))),
                        Member(f"{index:06d}.txt", f"caption {index}".encode())]
        tars.write(f"{number:02d}.tar", members)
        start += count
    return f"{tars.directory}/*.tar", start


def run_cli(*args: str):
    return runner.invoke(app, ["run", *args, *FLAGS, "-q"], catch_exceptions=False)


def check_buckets(out: str, samples: int) -> dict[int, int]:
    """Every sample once, each in a shard of its nearest bucket's shape; samples per bucket."""
    ds = shardio.open_dataset(out, verify=True)
    assert [tuple(b) for b in ds.buckets] == BUCKETS
    with open(os.path.join(out, "manifest.json"), encoding="utf-8") as f:
        root = json.load(f)
    assert root["format_version"] == 4 and root["buckets"] == [list(b) for b in BUCKETS]
    assert root["versions"]["format_version"] == 4  # what the run wrote, as `shardio info` shows it
    assert root["config"]["buckets"] == root["buckets"] and root["shape"] == [32, 32, 3]
    seen: list[int] = []
    per_bucket: dict[int, int] = {}
    for shard in range(len(ds.shards)):
        bucket = int(ds.shard_buckets[shard])
        assert ds.shard_shape(shard) == BUCKETS[bucket]
        entry = ds.shards[shard]
        assert entry.bucket == bucket
        decoded = [np.asarray(p) for p in ds.pixels(shard)]
        with open(os.path.join(out, entry.meta_path), encoding="utf-8") as f:
            lines = [json.loads(line) for line in f]
        assert len(lines) == len(decoded) == entry.samples
        for image, line in zip(decoded, lines):
            key = line["key"]
            assert image.shape == (*BUCKETS[bucket], 3)
            index = int(key)
            assert decode_index(image) == index
            width, height = SIZES[index % len(SIZES)]
            assert (line["width"], line["height"]) == (width, height)
            assert nearest_bucket(width, height, BUCKETS) == bucket, f"sample {key} in the wrong bucket"
            seen.append(index)
        per_bucket[bucket] = per_bucket.get(bucket, 0) + len(decoded)
    assert sorted(seen) == list(range(samples)), "a sample is missing or duplicated"
    return per_bucket


@pytest.mark.parametrize("encoding", ["raw", "jpeg"])
def test_every_sample_lands_once_in_a_shard_of_its_bucket(ray_cluster, tars, tmp_path, encoding) -> None:
    pattern, samples = make_tars(tars, [23, 17])
    out = str(tmp_path / "out")
    result = run_cli(pattern, "--output", out, "--encoding", encoding)
    assert result.exit_code == 0, result.output
    per_bucket = check_buckets(out, samples)
    expected: dict[int, int] = {}
    for index in range(samples):
        bucket = nearest_bucket(*SIZES[index % len(SIZES)], BUCKETS)
        expected[bucket] = expected.get(bucket, 0) + 1
    assert per_bucket == expected and len(expected) >= 4
    # Within an input: one open shard a bucket, full ones of samples_per_shard, the input's last of each
    # bucket partial; file numbers count the input's shards across its buckets.
    state = dataset_state(out)
    names = sorted(os.path.basename(s["path"]) for s in state["shards"])
    assert len(names) == len(set(names))
    # The rerun reads the stored config (the resolved list): nothing to do, nothing changed.
    again = runner.invoke(app, ["run", pattern, "--output", out, "-q"], catch_exceptions=False)
    assert again.exit_code == 0, again.output
    assert dataset_state(out) == state


def test_an_incremental_run_processes_only_the_new_input(ray_cluster, tars, tmp_path) -> None:
    pattern, samples = make_tars(tars, [11, 9])
    out, report = str(tmp_path / "out"), str(tmp_path / "report.json")
    assert run_cli(pattern, "--output", out).exit_code == 0
    before = dataset_state(out)
    tars.write("02.tar", [Member(f"{i:06d}.jpg", jpeg_bytes(index_image(i, *SIZES[i % len(SIZES)])))
                          for i in range(samples, samples + 7)])
    result = runner.invoke(app, ["run", pattern, "--output", out, *FLAGS, "--report", report],
                           catch_exceptions=False)
    assert result.exit_code == 0, result.output
    said = " ".join(result.output.split())
    counts: dict[str, int] = {}
    for index in range(samples, samples + 7):
        h, w = BUCKETS[nearest_bucket(*SIZES[index % len(SIZES)], BUCKETS)]
        counts[f"{h}x{w}"] = counts.get(f"{h}x{w}", 0) + 1
    expected = ", ".join(f"{h}x{w} {counts[f'{h}x{w}']}" for h, w in BUCKETS if f"{h}x{w}" in counts)
    assert f"samples written per bucket (h x w, as `shardio info`): {expected}" in said
    with open(report, encoding="utf-8") as f:
        doc = json.load(f)
    assert doc["inputs_skipped_count"] == 2 and len(doc["inputs_processed"]) == 1
    assert doc["samples_per_bucket"] == {f"{h}x{w}": counts[f"{h}x{w}"] for h, w in BUCKETS if f"{h}x{w}" in counts}
    check_buckets(out, samples + 7)
    after = dataset_state(out)
    assert {k: v for k, v in after["files"].items() if k in before["files"]} == before["files"]


def test_another_bucket_list_is_refused(ray_cluster, tars, tmp_path) -> None:
    pattern, _ = make_tars(tars, [5])
    out = str(tmp_path / "out")
    assert run_cli(pattern, "--output", out).exit_code == 0
    config = tmp_path / "other.yaml"
    config.write_text("buckets: [[32, 32], [24, 40], [40, 24]]\n")
    result = runner.invoke(app, ["run", pattern, "--output", out, "--config", str(config), "-q"])
    assert result.exit_code == 2, result.output
    assert "buckets: dataset has" in " ".join(result.output.split())


def test_verify_names_a_damaged_bucket_shard_and_repair_rebuilds_it(ray_cluster, tars, tmp_path) -> None:
    pattern, samples = make_tars(tars, [13, 8])
    out = str(tmp_path / "out")
    assert run_cli(pattern, "--output", out).exit_code == 0
    before = dataset_state(out)
    # A shard of a bucket whose shape is not the budget's.
    ds = shardio.open_dataset(out)
    shard = next(i for i in range(len(ds.shards)) if ds.shard_shape(i) != (32, 32))
    bad, (h, w) = before["shards"][shard], ds.shard_shape(shard)
    assert bad["path"] == ds.shards[shard].path
    path = os.path.join(out, bad["path"])
    assert os.path.getsize(path) == 128 + bad["samples"] * h * w * 3  # the header's shape is the bucket's
    flip_bits(path, 128 + h * w * 3 // 2, 0x10)
    result = runner.invoke(app, ["verify", out])
    assert result.exit_code == 1 and bad["path"] in result.output, result.output
    repaired = runner.invoke(app, ["verify", out, "--repair"])
    assert repaired.exit_code == 0, repaired.output
    after = dataset_state(out)
    assert after["shards"] == before["shards"] and after["files"] == before["files"], "not rebuilt byte for byte"
    assert_clean(out)
    check_buckets(out, samples)


@pytest.mark.parametrize("encoding", ["raw", "jpeg"])
def test_verify_names_shards_listed_in_a_swapped_bucket_and_repair_rebuilds_their_inputs(
        ray_cluster, tars, tmp_path, encoding) -> None:
    """16x48 and 48x16 shards have the same sizes: an index whose ids of the two were exchanged passes every
    size and checksum. verify reads each shard's header; --repair rebuilds the inputs behind them, whose
    images are given their buckets again (the shard files were right, the index wrong)."""
    pattern, samples = make_tars(tars, [13, 8])
    out = str(tmp_path / "out")
    assert run_cli(pattern, "--output", out, "--encoding", encoding).exit_code == 0
    before = dataset_state(out)
    wide, tall = BUCKETS.index((16, 48)), BUCKETS.index((48, 16))
    swapped = [e.path for e in shardio.open_dataset(out).shards if e.bucket in (wide, tall)]
    assert swapped and len(swapped) < len(before["shards"])
    swap_shard_buckets(out, wide, tall)
    result = runner.invoke(app, ["verify", out])
    said = " ".join(result.output.split())
    assert result.exit_code == 1 and said.count("BAD ") == len(swapped), result.output
    assert all(path in said for path in swapped) and "16x48" in said and "48x16" in said
    assert "--repair" in said
    repaired = runner.invoke(app, ["verify", out, "--repair"])
    assert repaired.exit_code == 0 and "repaired" in repaired.output, repaired.output
    after = dataset_state(out)
    assert after["shards"] == before["shards"] and after["files"] == before["files"], "not rebuilt byte for byte"
    assert_clean(out)
    check_buckets(out, samples)


def _start(pattern: str, out: str, address: str, log: str, encoding: str) -> subprocess.Popen:
    with open(log, "ab") as stderr:
        return subprocess.Popen([sys.executable, "-m", "preprocess.cli", "run", pattern, "--output", out, *FLAGS,
                                 "--encoding", encoding, "-q", "--ray-address", address],
                                stdout=subprocess.DEVNULL, stderr=stderr)


@pytest.mark.slow
@pytest.mark.parametrize("encoding", ["raw", "jpeg"])
def test_kill_9_then_rerun_gives_the_uninterrupted_dataset(ray_cluster, tars, tmp_path, encoding) -> None:
    pattern, samples = make_tars(tars, [40, 25, 33, 9])
    log, reference = str(tmp_path / "runs.log"), str(tmp_path / "reference")
    run = _start(pattern, reference, ray_cluster, log, encoding)
    startup_s, whole_s = watch(run, reference)
    assert run.returncode == 0, open(log).read()
    check_buckets(reference, samples)
    rng = random.Random(32)
    for attempt in range(2):
        # Killed at a random moment after its first shard file appeared: mid-write, mid-commit.
        out = str(tmp_path / f"out{attempt}")
        run = _start(pattern, out, ray_cluster, log, encoding)
        watch(run, out, ("write", rng.uniform(0.0, whole_s - startup_s)))
        wait_for_dead_runs_tasks()
        result = runner.invoke(app, ["run", pattern, "--output", out, *FLAGS, "--encoding", encoding, "-q"],
                               catch_exceptions=False)
        assert result.exit_code == 0, result.output
        assert_same_dataset(out, reference)
        assert_clean(out)
        assert list(shardio.open_dataset(out).shard_buckets) == list(shardio.open_dataset(reference).shard_buckets)
