"""bench.buckets: the aspect figures are the transform's stored shapes against the sources, and the job
rounds alternate the two modes with a per-round ratio (no Ray: the job is scripted); the bench's rows; the
synthetic bucketed index ``bench.bucket_index`` measures is a valid version 4 index."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest

from bench import buckets as bench_buckets
from bench.run_figures import _bucket_figures
from preprocess.config import JobConfig
from shardio.format.manifests import load_index
from tests.tar_factory import index_image, jpeg_bytes


@dataclass
class _Report:
    samples_written: int


def test_rounds_alternate_the_modes_and_ratios_are_per_round(monkeypatch, tmp_path) -> None:
    calls: list[str] = []
    durations = iter([9.0, 9.0,  # warm-up: one run of each mode
                      4.0, 5.0,  # round 1: center_crop (300 img/s), bucket (240): 0.8
                      3.0, 4.0])  # round 2: bucket (400), center_crop (300): 1.333

    def scripted_run(tars, output, cfg, workers=None):
        calls.append(cfg.mode)
        assert cfg.height == cfg.width == 256 and (cfg.buckets is None) == (cfg.mode == "center_crop")
        return next(durations), _Report(200 * len(tars))

    monkeypatch.setattr(bench_buckets, "_run", scripted_run)
    result = bench_buckets.bucket_crop_rounds(list("abcdef"), str(tmp_path), JobConfig(), 2, log=lambda _: None)
    assert calls == ["center_crop", "bucket", "center_crop", "bucket", "bucket", "center_crop"]
    assert [r["ratio"] for r in result["rounds"]] == [0.8, 1.3333]
    assert result["ratio_median"] == pytest.approx((0.8 + 1.3333) / 2, abs=1e-4)


def test_aspect_figures_are_the_stored_shapes_against_the_sources() -> None:
    sizes = [(300, 200), (200, 300), (256, 256), (600, 150)]
    images = [jpeg_bytes(index_image(i, w, h)) for i, (w, h) in enumerate(sizes)]
    cfg = JobConfig(height=64, width=64, mode="bucket", bucket_step=8)
    got = bench_buckets.aspect_figures(images, cfg)
    assert got["images"] == 4 and sum(got["samples_per_bucket"].values()) == 4
    assert got["center_crop"]["max"] == round(math.log(4), 4)
    # 600x150 (4:1) goes to the widest bucket (3:1 at most): its error is the largest.
    widest = max(cfg.buckets, key=lambda b: b[1] / b[0])
    assert got["bucket"]["max"] == round(math.log(4) - math.log(widest[1] / widest[0]), 4)
    assert 0.7 <= got["area_min"] <= got["area_max"] <= 1.0


def test_the_crop_spread_is_laion_like_and_the_defaults_meet_the_targets() -> None:
    spread = bench_buckets.crop_spread(JobConfig(mode="bucket"), images=5000)
    assert 0.3 < spread["center_crop"]["median"] < 0.45 and 0.9 < spread["center_crop"]["p95"] < 1.15
    assert spread["bucket"]["median"] <= bench_buckets.TARGET_MEDIAN
    assert spread["bucket"]["p95"] <= bench_buckets.TARGET_P95


def test_the_bench_rows() -> None:
    result = {"budget": "256x256", "buckets": [[256, 256]],
              "aspect": {"images": 9, "bucket": {"median": 0.02, "p95": 0.1, "max": 0.3},
                         "center_crop": {"median": 0.4, "p95": 0.9, "max": 1.0}, "area_min": 0.95, "area_max": 1.0},
              "crop_spread": {"images": 9, "bucket": {"median": 0.03, "p95": 0.2, "max": 0.4},
                              "center_crop": {"median": 0.4, "p95": 1.0, "max": 1.2}},
              "job": {"rounds": [{}], "ratio_median": 0.94, "ratio_min": 0.9, "ratio_max": 1.0,
                      "bucket_images_per_s": 94.0, "center_crop_images_per_s": 100.0}}
    rows = {row["name"]: row for row in _bucket_figures(result)}
    assert [row["met"] for row in rows.values()] == [True, True, True, False]
    assert rows["job bucket / job center_crop (images/s)"]["target"] == 0.95


def test_the_benchs_synthetic_bucketed_index_is_a_valid_version_4_index(tmp_path):
    """``bench.synthetic_index --buckets``, what ``bench.bucket_index`` measures: it loads, checked, with
    shard ``i`` in bucket ``7 i % buckets``; without buckets it is a version 3 index."""
    from bench.bucket_index import child
    from bench.synthetic_index import write_index

    bucketed, plain = str(tmp_path / "b"), str(tmp_path / "p")
    write_index(bucketed, 1000, buckets=20)
    write_index(plain, 1000)
    index = load_index(bucketed)
    assert index.format_version == 4 and len(index.buckets) == 20 == len(set(index.buckets))
    assert index.shards.bucket_ids().tolist() == [(7 * i) % 20 for i in range(1000)]
    assert load_index(plain).format_version == 3 and not load_index(plain).is_bucketed
    assert child(bucketed)["buckets"] == 20 and child(plain)["buckets"] == 1
