"""``preprocess diagnose``: per-stage timings on generated tars, the report's arithmetic, the CLI's exits; what
the shards will hold, and for ``encoding: jpeg`` the quality measured against the raw pixels; in ``mode: bucket``
the aspect error against the source beside a centre crop's, samples per bucket, and the scratch shards written one
bucket each."""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest
from typer.testing import CliRunner

from preprocess.cli import app
from preprocess.image.buckets import aspect_error, nearest_bucket
from preprocess.config import JobConfig
from preprocess.diagnose import STAGES, diagnose
from preprocess.sample_data import make_sample_dataset
from preprocess.worker import process_input
from shardio.format.jpeg_shard import jpeg_data_start
from tests.tar_factory import Member, index_image, jpeg_bytes

runner = CliRunner()


@pytest.fixture
def mixed_tar(tars) -> str:
    # 12 good JPEGs of 320x240 (a 32x32 target decodes them at 1/4 scale: 80x60), one empty, one text.
    members = tars.samples(range(12)) + [Member("000012.jpg", b""), Member("000013.jpg", b"not a jpeg")]
    return tars.write("mixed.tar", members)


@pytest.fixture(scope="module")
def photo_tar(tmp_path_factory) -> str:
    # 8 photo-like JPEGs of 1-2.5 MP with texture and grain (not flat colour: a flat image survives JPEG
    # almost exactly and would tell nothing about quality), one of them grayscale; ~1 s to make.
    [path] = make_sample_dataset(str(tmp_path_factory.mktemp("photos")), tars=1, samples_per_tar=8)
    return path


def jpeg_config(quality: int = 90) -> JobConfig:
    return JobConfig(height=64, width=64, samples_per_shard=5, encoding="jpeg", quality=quality)


def test_every_stage_is_timed_and_the_shares_add_up(mixed_tar, tmp_path):
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    cfg = JobConfig(height=32, width=32, samples_per_shard=5)
    report = diagnose([mixed_tar], cfg, project_images=1000, cores=4, write_dir=str(scratch))
    assert report["samples"] == 12 and report["samples_failed"] == 2
    assert sum(report["failures_by_reason"].values()) == 2
    assert set(report["stages"]) == set(STAGES) - {"encode"}  # raw: nothing is encoded
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
    assert report["jpeg_decoder"].startswith("region decode")  # make install builds preprocess.image._jpeg_region
    rate = report["images_per_s_per_core"]
    assert report["projection"]["seconds"] == pytest.approx(1000 / (rate * 4), rel=0.01)
    slowest = report["slowest"]
    assert len(slowest) == 5 and slowest[0]["total_ms"] >= slowest[-1]["total_ms"]
    assert slowest[0]["format"] == "JPEG" and slowest[0]["mode"] == "RGB" and slowest[0]["size"] == "320x240"
    assert report["bottleneck"] in STAGES
    assert report["verdict"].startswith(f"bottleneck: {report['bottleneck']}")
    assert os.listdir(scratch) == [], "the scratch shards were not removed"
    assert report["pixels"] == {"encoding": "raw", "raw_bytes_per_image": 32 * 32 * 3, "bytes_per_image": 3072,
                                "projection": {"images": 1000, "bytes": 3_072_000, "human": "3.1 MB"}}


def test_jpeg_quality_is_measured_against_the_raw_pixels(photo_tar, tmp_path):
    report = diagnose([photo_tar], jpeg_config(), project_images=1000)
    pixels = report["pixels"]
    assert report["samples"] == pixels["images"] == 8
    assert (pixels["encoding"], pixels["quality"], pixels["subsampling"]) == ("jpeg", 90, "4:4:4")
    score = pixels["psnr_db"]
    assert 30 < score["min"] <= score["p5"] <= score["median"] < 60, score
    assert 0 < pixels["max_abs_error"] < 128
    assert 0 < pixels["bytes_per_image"] < pixels["raw_bytes_per_image"] == 64 * 64 * 3
    assert pixels["projection"]["bytes"] == pytest.approx(pixels["bytes_per_image"] * 1000, abs=100)
    assert report["stages"]["encode"]["mean_ms"] > 0  # the job's encode is a stage of its own
    assert set(report["stages"]) == set(STAGES)

    # The same bytes the job writes: its shards of this tar hold JPEGs of the same mean size.
    stat = os.stat(photo_tar)
    result = process_input(photo_tar, str(tmp_path / "job"), jpeg_config(), (stat.st_size, stat.st_mtime_ns))
    jpeg_bytes = sum(s["bytes"] - jpeg_data_start(s["samples"]) for s in result.shards)
    assert result.samples == 8 and pixels["bytes_per_image"] == pytest.approx(jpeg_bytes / 8, abs=0.05)


def test_a_lower_quality_measures_worse_and_smaller(photo_tar):
    low, high = (diagnose([photo_tar], jpeg_config(quality))["pixels"] for quality in (10, 95))
    assert low["psnr_db"]["median"] < high["psnr_db"]["median"] - 5, (low, high)
    assert low["psnr_db"]["p5"] < high["psnr_db"]["p5"]
    assert low["max_abs_error"] > high["max_abs_error"]
    assert low["bytes_per_image"] < high["bytes_per_image"]


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
                 "slowest samples", "failed samples: 2", "verdict: bottleneck:", "JPEG decoder: region decode",
                 "pixels: raw, 3,072 bytes an image", "2,000,000 images: about 6.1 GB of pixel files"):
        assert text in result.output, text
    result = runner.invoke(app, ["diagnose", mixed_tar, "--config", str(config), "--limit", "3", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["samples"] == 3 and report["config"]["height"] == 32


def test_cli_shows_the_jpeg_quality_in_text_and_json(photo_tar, tmp_path):
    config = tmp_path / "jpeg.yaml"
    config.write_text("height: 64\nwidth: 64\nencoding: jpeg\nquality: 85\n")
    result = runner.invoke(app, ["diagnose", photo_tar, "--config", str(config), "--project-images", "1000"])
    assert result.exit_code == 0, result.output
    said = " ".join(result.output.split())
    for text in ("pixels: jpeg q85 4:4:4", "of raw); PSNR against raw over 8 images: median", "max abs error",
                 "1,000 images: about", "encode"):
        assert text in said, text
    result = runner.invoke(app, ["diagnose", photo_tar, "--config", str(config), "--json"])
    assert result.exit_code == 0, result.output
    pixels = json.loads(result.output)["pixels"]
    assert pixels["quality"] == 85 and pixels["psnr_db"]["median"] > 30 and pixels["bytes_per_image"] < 12288


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


def test_resize_verdict_on_stock_pillow_quotes_what_the_bench_measures():
    # make bench measures a full decode + resize 1.7-2.0x slower on stock Pillow (bench/paths.py); the
    # verdict must not promise more, and says how to get Pillow-SIMD back.
    from preprocess.diagnose import _verdict

    report = {"bottleneck": "resize", "stages": {"resize": {"share": 0.4}}}
    stock = _verdict(report, [], JobConfig(), {"pillow_simd": False})
    assert "1.7-2.0x" in stock and "6-8x" not in stock and "make install" in stock
    simd = _verdict(report, [], JobConfig(), {"pillow_simd": True})
    assert "with Pillow-SIMD" in simd and "1.7-2.0x" not in simd


# --- mode: bucket --------------------------------------------------------------------------------------------------

# Upright sizes: 1:1, 3:2, 2:3, 16:9 and 3.6:1 (past the 3:1 bucket).
BUCKET_SOURCE_SIZES = [(300, 300), (360, 240), (240, 360), (448, 252), (540, 150)]


def _shapes_tar(tars) -> str:
    return tars.write("shapes.tar", [Member(f"{i:06d}.jpg", jpeg_bytes(index_image(i, w, h)))
                                     for i, (w, h) in enumerate(BUCKET_SOURCE_SIZES * 3)])


def test_the_aspect_report_against_the_source_and_a_centre_crop(tars) -> None:
    cfg = JobConfig(height=64, width=64, mode="bucket", bucket_step=8, samples_per_shard=2)
    report = diagnose([_shapes_tar(tars)], cfg)
    assert report["samples"] == 15 and report["samples_failed"] == 0
    aspect = report["aspect"]
    source = np.array([abs(math.log(w / h)) for w, h in BUCKET_SOURCE_SIZES * 3])
    assert aspect["center_crop"]["median"] == round(float(np.median(source)), 4)
    assert aspect["center_crop"]["max"] == round(math.log(540 / 150), 4)
    kept = np.array([aspect_error(w, h, cfg.buckets[nearest_bucket(w, h, cfg.buckets)])
                     for w, h in BUCKET_SOURCE_SIZES * 3])
    assert aspect["bucket"] == {"median": round(float(np.median(kept)), 4),
                                "p95": round(float(np.percentile(kept, 95)), 4), "max": round(float(kept.max()), 4)}
    assert aspect["bucket"]["median"] < aspect["center_crop"]["median"] / 3
    assert sum(aspect["samples_per_bucket"].values()) == 15
    expected: dict[str, int] = {}
    for w, h in BUCKET_SOURCE_SIZES * 3:
        bh, bw = cfg.buckets[nearest_bucket(w, h, cfg.buckets)]
        expected[f"{bh}x{bw}"] = expected.get(f"{bh}x{bw}", 0) + 1
    assert aspect["samples_per_bucket"] == expected and expected["64x64"] == 3 and len(expected) == 4
    # A raw image's bytes are its bucket's: the mean over the samples.
    assert report["pixels"]["bytes_per_image"] < 64 * 64 * 3


def test_other_modes_have_no_aspect_report(tars) -> None:
    assert "aspect" not in diagnose([_shapes_tar(tars)], JobConfig(height=32, width=32))


def test_cli_prints_the_aspect_line(tars, tmp_path) -> None:
    config = tmp_path / "buckets.yaml"
    config.write_text("height: 64\nwidth: 64\nmode: bucket\nbucket_step: 8\nencoding: jpeg\n")
    result = runner.invoke(app, ["diagnose", _shapes_tar(tars), "--config", str(config)])
    assert result.exit_code == 0, result.output
    said = " ".join(result.output.split())
    assert "aspect ratio |log(w/h)| changed by: buckets median" in said
    assert "a centre crop to 64x64 would: median 0.406" in said
    result = runner.invoke(app, ["diagnose", _shapes_tar(tars), "--config", str(config), "--json"])
    assert json.loads(result.output)["aspect"]["buckets"] == len(JobConfig(height=64, width=64, mode="bucket",
                                                                           bucket_step=8).buckets)
