"""bench.job_jpeg: the raw and the jpeg job alternate in rounds (which encoding goes first, and small/large
order, alternating), each round's ratio is jpeg / raw of its own steady rates, the figure their median; the
JPEG output is scored against the raw output of the same images (no Ray: the job is scripted, the quality
is measured on datasets written by the shard writer)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import pytest

from bench import job_jpeg
from preprocess.config import JobConfig
from tests.dataset_fixtures import write_inputs


@dataclass
class _Report:
    samples_written: int


def test_rounds_interleave_the_encodings_and_ratios_are_per_round(monkeypatch, tmp_path):
    calls: list[str] = []
    # Seconds per run over 6 tars of 200 images: 1,200 / seconds images/s.
    durations = iter([9.0, 9.0,  # warm-up: one run of each encoding
                      4.0, 5.0,  # round 1: raw (300 img/s), jpeg (240): 0.8
                      3.0, 4.0,  # round 2: jpeg (400), raw (300): 1.333
                      6.0, 8.0])  # round 3: raw (200), jpeg (150): 0.75

    def scripted_run(tars, output, cfg, workers=None):
        calls.append(cfg.encoding)
        assert len(tars) == 6 and cfg.quality == 90 and cfg.height == 256  # all but the encoding as given
        return next(durations), _Report(200 * len(tars))

    monkeypatch.setattr(job_jpeg, "_run", scripted_run)
    monkeypatch.setattr(job_jpeg, "dataset_quality", lambda jpeg_dir, raw_dir: {"compared": (jpeg_dir, raw_dir)})
    result = job_jpeg.jpeg_raw_rounds(list("abcdef"), str(tmp_path), JobConfig(), rounds=3, log=lambda _: None)
    assert calls == ["raw", "jpeg", "raw", "jpeg", "jpeg", "raw", "raw", "jpeg"]
    assert [(r["first"], r["ratio"]) for r in result["rounds"]] == [("raw", 0.8), ("jpeg", 1.3333), ("raw", 0.75)]
    assert result["ratio_median"] == 0.8 and (result["ratio_min"], result["ratio_max"]) == (0.75, 1.3333)
    assert result["raw_images_per_s"] == 300.0 and result["jpeg_images_per_s"] == 240.0
    assert result["quality"]["compared"] == (str(tmp_path / "jpeg"), str(tmp_path / "raw"))
    assert job_jpeg.TARGET == 0.85


SIDE = 32


def textured(index: int) -> np.ndarray:
    """Smooth gradients and mild noise (a flat test colour survives JPEG almost exactly: it scores nothing)."""
    rng = np.random.default_rng(index)
    y, x = np.mgrid[0:SIDE, 0:SIDE].astype(np.float64)
    image = np.stack([128 + 90 * np.sin(x / (3 + index % 5)), 128 + 80 * np.cos(y / 4 + index), (x + y) * 4],
                     axis=-1)
    return np.clip(image + rng.normal(0, 3, image.shape), 0, 255).astype(np.uint8)


def same_images(directory: str, inputs: tuple[int, ...], encoding: str) -> None:
    write_inputs(directory, inputs, lambda i, n, name: {"key": f"s{i:06d}", "tar": name}, height=SIDE,
                 width=SIDE, pixels_for=textured, encoding=encoding)


def test_the_jpeg_output_is_scored_against_the_raw_output_of_the_same_images(tmp_path):
    raw, jpeg = str(tmp_path / "raw"), str(tmp_path / "jpeg")
    same_images(raw, (12, 5), "raw")
    same_images(jpeg, (12, 5), "jpeg")
    quality = job_jpeg.dataset_quality(jpeg, raw)
    assert quality["images"] == 17 and quality["raw_bytes_per_image"] == SIDE * SIDE * 3
    assert 0 < quality["bytes_per_image"] < SIDE * SIDE * 3
    score = quality["psnr_db"]
    assert score["min"] is not None and 30 < score["min"] <= score["p5"] <= score["median"]
    assert 0 < quality["max_abs_error"] < 64


def test_datasets_of_different_samples_are_refused(tmp_path):
    raw, jpeg = str(tmp_path / "raw"), str(tmp_path / "jpeg")
    same_images(raw, (12,), "raw")
    same_images(jpeg, (12, 5), "jpeg")
    with pytest.raises(RuntimeError, match="hold different samples: 17 vs 12"):
        job_jpeg.dataset_quality(jpeg, raw)


def test_worker_cpu_rounds_time_both_encodings_of_the_same_tar(tars, tmp_path):
    tar = tars.make("a.tar", range(10))
    cpu = job_jpeg.worker_cpu_rounds(tar, str(tmp_path / "runs"), JobConfig(height=32, width=32), rounds=2)
    assert len(cpu["raw_ms"]) == len(cpu["jpeg_ms"]) == 2 and cpu["rounds"] == 2
    assert cpu["raw_cpu_ms_per_image"] > 0 and cpu["jpeg_cpu_ms_per_image"] > 0
    assert cpu["ratio"] == pytest.approx(cpu["raw_cpu_ms_per_image"] / cpu["jpeg_cpu_ms_per_image"], rel=1e-3)
    assert os.listdir(tmp_path / "runs") == [], "the workers' outputs were not removed"
