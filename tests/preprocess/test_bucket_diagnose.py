"""``preprocess diagnose`` in ``mode: bucket``: the aspect error against the source beside a centre crop's,
samples per bucket, and the scratch shards written one bucket each."""

from __future__ import annotations

import json
import math

import numpy as np
from typer.testing import CliRunner

from preprocess.image.buckets import aspect_error, nearest_bucket
from preprocess.cli import app
from preprocess.config import JobConfig
from preprocess.diagnose import diagnose
from tests.tar_factory import Member, index_image, jpeg_bytes

runner = CliRunner()
# Upright sizes: 1:1, 3:2, 2:3, 16:9 and 3.6:1 (past the 3:1 bucket).
SIZES = [(300, 300), (360, 240), (240, 360), (448, 252), (540, 150)]


def _tar(tars) -> str:
    return tars.write("shapes.tar", [Member(f"{i:06d}.jpg", jpeg_bytes(index_image(i, w, h)))
                                     for i, (w, h) in enumerate(SIZES * 3)])


def test_the_aspect_report_against_the_source_and_a_centre_crop(tars) -> None:
    cfg = JobConfig(height=64, width=64, mode="bucket", bucket_step=8, samples_per_shard=2)
    report = diagnose([_tar(tars)], cfg)
    assert report["samples"] == 15 and report["samples_failed"] == 0
    aspect = report["aspect"]
    source = np.array([abs(math.log(w / h)) for w, h in SIZES * 3])
    assert aspect["center_crop"]["median"] == round(float(np.median(source)), 4)
    assert aspect["center_crop"]["max"] == round(math.log(540 / 150), 4)
    kept = np.array([aspect_error(w, h, cfg.buckets[nearest_bucket(w, h, cfg.buckets)]) for w, h in SIZES * 3])
    assert aspect["bucket"] == {"median": round(float(np.median(kept)), 4),
                                "p95": round(float(np.percentile(kept, 95)), 4), "max": round(float(kept.max()), 4)}
    assert aspect["bucket"]["median"] < aspect["center_crop"]["median"] / 3
    assert sum(aspect["samples_per_bucket"].values()) == 15
    expected: dict[str, int] = {}
    for w, h in SIZES * 3:
        bh, bw = cfg.buckets[nearest_bucket(w, h, cfg.buckets)]
        expected[f"{bh}x{bw}"] = expected.get(f"{bh}x{bw}", 0) + 1
    assert aspect["samples_per_bucket"] == expected and expected["64x64"] == 3 and len(expected) == 4
    # A raw image's bytes are its bucket's: the mean over the samples.
    assert report["pixels"]["bytes_per_image"] < 64 * 64 * 3


def test_other_modes_have_no_aspect_report(tars) -> None:
    assert "aspect" not in diagnose([_tar(tars)], JobConfig(height=32, width=32))


def test_cli_prints_the_aspect_line(tars, tmp_path) -> None:
    config = tmp_path / "buckets.yaml"
    config.write_text("height: 64\nwidth: 64\nmode: bucket\nbucket_step: 8\nencoding: jpeg\n")
    result = runner.invoke(app, ["diagnose", _tar(tars), "--config", str(config)])
    assert result.exit_code == 0, result.output
    said = " ".join(result.output.split())
    assert "aspect ratio |log(w/h)| changed by: buckets median" in said
    assert "a centre crop to 64x64 would: median 0.406" in said
    result = runner.invoke(app, ["diagnose", _tar(tars), "--config", str(config), "--json"])
    assert json.loads(result.output)["aspect"]["buckets"] == len(JobConfig(height=64, width=64, mode="bucket",
                                                                           bucket_step=8).buckets)
