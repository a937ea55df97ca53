"""``preprocess diagnose``: per-stage timings on generated tars, the report's arithmetic, the CLI's exits."""

from __future__ import annotations

import json
import os

import pytest
from typer.testing import CliRunner

from preprocess.cli import app
from preprocess.config import JobConfig
from preprocess.diagnose import STAGES, diagnose
from tests.tar_factory import Member

runner = CliRunner()


@pytest.fixture
def mixed_tar(tars) -> str:
    # 12 good JPEGs of 320x240 (a 32x32 target decodes them at 1/4 scale: 80x60), one empty, one text.
    members = tars.samples(range(12)) + [Member("000012.jpg", b""), Member("000013.jpg", b"not a jpeg")]
    return tars.write("mixed.tar", members)


def test_every_stage_is_timed_and_the_shares_add_up(mixed_tar, tmp_path):
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    cfg = JobConfig(height=32, width=32, samples_per_shard=5)
    report = diagnose([mixed_tar], cfg, project_images=1000, cores=4, write_dir=str(scratch))
    assert report["samples"] == 12 and report["samples_failed"] == 2
    assert sum(report["failures_by_reason"].values()) == 2
    assert set(report["stages"]) == set(STAGES)
    for stage in report["stages"].values():
        assert 0 <= stage["p50_ms"] <= stage["p95_ms"] and stage["mean_ms"] >= 0
    assert sum(s["share"] for s in report["stages"].values()) == pytest.approx(1.0, abs=0.01)
    assert report["stages"]["decode"]["mean_ms"] > 0 and report["stages"]["write"]["mean_ms"] > 0
    assert report["stages"]["commit"]["mean_ms"] > 0  # the shard's checksum, fsync and rename, spread
    # The tar's index pass is its own stage, spread evenly over the tar's images (p50 == p95 == mean).
    index = report["stages"]["index"]
    assert index["mean_ms"] > 0
    assert index["p50_ms"] == index["p95_ms"] == pytest.approx(index["mean_ms"], abs=0.002)
    assert report["draft_scales"] == {"1/4": 12}
    assert report["jpeg_decoder"].startswith("region decode")  # make install builds preprocess._jpeg_region
    rate = report["images_per_s_per_core"]
    assert report["projection"]["seconds"] == pytest.approx(1000 / (rate * 4), rel=0.01)
    slowest = report["slowest"]
    assert len(slowest) == 5 and slowest[0]["total_ms"] >= slowest[-1]["total_ms"]
    assert slowest[0]["format"] == "JPEG" and slowest[0]["mode"] == "RGB" and slowest[0]["size"] == "320x240"
    assert report["bottleneck"] in STAGES
    assert report["verdict"].startswith(f"bottleneck: {report['bottleneck']}")
    assert os.listdir(scratch) == [], "the scratch shards were not removed"


def test_limit_stops_across_inputs(tars):
    first, second = tars.make("a.tar", range(4)), tars.make("b.tar", range(4, 10))
    report = diagnose([first, second], JobConfig(height=16, width=16), limit=6)
    assert report["samples"] == 6 and report["inputs_read"] == [first, second]


def test_cli_prints_the_table_and_the_verdict(mixed_tar, tmp_path):
    config = tmp_path / "small.yaml"
    config.write_text("height: 32\nwidth: 32\n")
    result = runner.invoke(app, ["diagnose", mixed_tar, "--config", str(config), "--cores", "8",
                                 "--project-images", "2000000"])
    assert result.exit_code == 0, result.output
    for text in ("p95 ms", "decode", "resize", "write", "images/s per core", "2,000,000 images on 8 cores",
                 "slowest samples", "failed samples: 2", "verdict: bottleneck:", "JPEG decoder: region decode"):
        assert text in result.output, text
    result = runner.invoke(app, ["diagnose", mixed_tar, "--config", str(config), "--limit", "3", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["samples"] == 3 and report["config"]["height"] == 32


def test_cli_exit_codes_for_bad_inputs_and_bad_config(tars, tmp_path):
    good = tars.make("good.tar", range(3))
    result = runner.invoke(app, ["diagnose", good, str(tmp_path / "missing.tar")])
    assert result.exit_code == 1 and "missing.tar: no such file" in result.output.replace("\n", "")
    not_tar = tars.path("junk.tar")
    open(not_tar, "wb").write(b"\x00junk" * 50)
    result = runner.invoke(app, ["diagnose", not_tar, "--json"])
    assert result.exit_code == 1
    assert json.loads(result.output)["inputs_failed"][0]["input"] == not_tar
    bad_config = tmp_path / "bad.yaml"
    bad_config.write_text("hieght: 32\n")
    result = runner.invoke(app, ["diagnose", good, "--config", str(bad_config)])
    assert result.exit_code == 2 and "unknown key" in result.output
