"""The job end to end through the CLI (in-process, typer's CliRunner): exit codes, report, shards."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from typer.testing import CliRunner

import shardio
from preprocess.cli import app
from tests.tar_factory import Member, decode_index

pytestmark = pytest.mark.ray
runner = CliRunner()


def run_cli(*args: str):
    return runner.invoke(app, ["run", *args, "-q"], catch_exceptions=False)


def read_all(directory: str) -> tuple[list[int], list[str]]:
    ds = shardio.open_dataset(directory, verify=True)
    indices, keys = [], []
    for i in range(len(ds.shards)):
        pixels, meta = ds.pixels(i), ds.meta(i)
        indices += [decode_index(p) for p in pixels]
        keys += meta.keys
    return indices, keys


def test_tars_to_shards_keeps_every_sample_once_in_order(ray_cluster, tars, tmp_path):
    tars.make("a.tar", range(0, 23))
    tars.make("b.tar", range(23, 40))
    out = str(tmp_path / "out")
    result = run_cli(f"{tars.directory}/*.tar", "--output", out, "--size", "32", "--samples-per-shard", "8")
    assert result.exit_code == 0, result.output
    indices, keys = read_all(out)
    assert sorted(indices) == list(range(40)), "a sample is missing or duplicated"
    assert indices == list(range(40)), "samples are out of tar order"
    assert keys == [f"{i:06d}" for i in range(40)]
    manifest = json.load(open(os.path.join(out, "manifest.json")))
    assert [s["samples"] for s in manifest["shards"]] == [8, 8, 7, 8, 8, 1]
    assert manifest["shape"] == [32, 32, 3] and manifest["samples"] == 40
    ds = shardio.open_dataset(out)
    meta = ds.meta(0)
    assert meta.txt[:2] == ["caption 0", "caption 1"] and list(meta.cls[:3]) == [0, 1, 2]
    assert meta.json[1] == {"index": 1}
    # A stranger reads a shard with numpy alone.
    first = np.load(os.path.join(out, manifest["shards"][0]["path"]), mmap_mode="r")
    assert first.shape == (8, 32, 32, 3) and first.dtype == np.uint8


def test_report_names_bad_samples_and_bad_inputs(ray_cluster, tars, tmp_path):
    good = tars.make("good.tar", range(5))
    members = tars.samples(range(10, 13)) + [
        Member("000013.jpg", b""),  # zero bytes
        Member("000014.jpg", b"this is text, not a jpeg"),
        Member("000015.txt", b"metadata but no image"),
    ]
    mixed = tars.write("mixed.tar", members)
    not_tar = tars.path("not_a_tar.tar")
    open(not_tar, "wb").write(b"\x00garbage" * 100)
    out, report_path = str(tmp_path / "out"), str(tmp_path / "report.json")
    result = run_cli(good, mixed, not_tar, str(tmp_path / "missing.tar"), "--output", out, "--size", "16",
                     "--report", report_path)
    assert result.exit_code == 1, result.output
    report = json.load(open(report_path))
    assert report["samples_written"] == 8 and report["samples_failed"] == 3
    reasons = {f["key"]: f["reason"] for f in report["failures"]}
    assert "empty" in reasons["000013"] and "text" in reasons["000014"] and "no image" in reasons["000015"]
    failed = {os.path.basename(f["input"]): f["reason"] for f in report["inputs_failed"]}
    assert set(failed) == {"not_a_tar.tar", "missing.tar"}
    assert "no such file" in failed["missing.tar"]
    assert sorted(report["inputs_processed"]) == sorted([good, mixed])
    for key in ("inputs_skipped", "elapsed_s", "images_per_s"):
        assert key in report
    # The report is also kept in the output (the run history) and the good inputs are committed.
    assert os.listdir(os.path.join(out, "reports"))
    assert len(shardio.open_dataset(out)) == 8


def test_rerun_skips_committed_inputs(ray_cluster, tars, tmp_path):
    tars.make("a.tar", range(4))
    out = str(tmp_path / "out")
    assert run_cli(f"{tars.directory}/*.tar", "--output", out, "--size", "16").exit_code == 0
    tars.make("b.tar", range(4, 6))
    report_path = str(tmp_path / "r.json")
    assert run_cli(f"{tars.directory}/*.tar", "--output", out, "--size", "16", "--report", report_path).exit_code == 0
    report = json.load(open(report_path))
    assert [os.path.basename(p) for p in report["inputs_skipped"]] == ["a.tar"]
    assert [os.path.basename(p) for p in report["inputs_processed"]] == ["b.tar"]
    assert read_all(out)[0] == list(range(6))


@pytest.mark.parametrize(
    "args, message",
    [
        (["--size", "16", "--height", "8"], "not both"),
        (["--mode", "zoom"], "mode must be one of"),
        (["--samples-per-shard", "0"], "samples_per_shard"),
    ],
)
def test_usage_errors_exit_2(tmp_path, args, message):
    result = runner.invoke(app, ["run", "x.tar", "--output", str(tmp_path / "o"), *args])
    assert result.exit_code == 2
    assert message in result.output


def test_unknown_config_key_exits_2(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("height: 64\nwidht: 64\n")
    result = runner.invoke(app, ["run", "x.tar", "--output", str(tmp_path / "o"), "--config", str(config)])
    assert result.exit_code == 2
    assert "unknown key(s) widht" in result.output


def test_unreachable_ray_address_fails_fast(tars, tmp_path):
    tars.make("a.tar", range(2))
    result = runner.invoke(app, ["run", tars.made[0], "--output", str(tmp_path / "o"),
                                 "--ray-address", "127.0.0.1:1"])
    assert result.exit_code == 2
    assert "unreachable" in result.output


def test_different_config_on_existing_output_is_refused(ray_cluster, tars, tmp_path):
    tars.make("a.tar", range(3))
    out = str(tmp_path / "out")
    assert run_cli(tars.made[0], "--output", out, "--size", "16").exit_code == 0
    result = runner.invoke(app, ["run", tars.made[0], "--output", out, "--size", "24"])
    assert result.exit_code == 2
    assert "different config" in result.output and "height" in result.output
    assert shardio.open_dataset(out).shape == (16, 16, 3)


def test_job_spreads_over_both_nodes_of_the_cluster(ray_cluster, tars, tmp_path):
    # Enough work per input (~0.3 s) that the second node's fresh worker starts before the first node
    # has drained the queue; with tiny inputs one warm worker can finish everything alone.
    for t in range(8):
        tars.make(f"{t}.tar", range(t * 30, t * 30 + 30), size=(1200, 900))
    out, report_path = str(tmp_path / "out"), str(tmp_path / "r.json")
    result = run_cli(f"{tars.directory}/*.tar", "--output", out, "--size", "16", "--report", report_path)
    assert result.exit_code == 0
    report = json.load(open(report_path))
    assert report["cluster"]["nodes"] == 2
    assert len(report["inputs_per_node"]) == 2, report["inputs_per_node"]
    assert read_all(out)[0] == list(range(240))
