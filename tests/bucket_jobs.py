"""The bucketed job's tests' tars, flags and checks (``mode: bucket`` through ``preprocess run``): sources of six
aspect ratios whose flat colours say the sample, and a check that every sample is once in a shard of its nearest
bucket's shape. The tests are beside the single-shape job's: tests/preprocess/test_cli_job.py, test_incremental.py,
test_verify.py and test_crash_safety.py."""

from __future__ import annotations

import json
import os

import numpy as np
from typer.testing import CliRunner

import shardio
from preprocess.cli import app
from preprocess.config import JobConfig
from preprocess.image.buckets import nearest_bucket
from tests.tar_factory import Member, decode_index, index_image, jpeg_bytes

__all__ = ["BUCKET_FLAGS", "JOB_BUCKETS", "SOURCE_SIZES", "make_bucket_tars", "run_bucket_job", "check_buckets"]

runner = CliRunner()
# A 32x32 budget, sides multiples of 8: 16x48, 24x40, 32x32, 40x24, 48x16 (h x w).
BUCKET_FLAGS = ["--size", "32", "--mode", "bucket", "--bucket-step", "8", "--samples-per-shard", "4"]
JOB_BUCKETS = JobConfig(height=32, width=32, mode="bucket", bucket_step=8).buckets
# Source sizes (w, h): square, 3:2, 2:3, 8:3, 3:8, 5:4; flat colours: the centre pixel says the sample.
SOURCE_SIZES = [(96, 96), (120, 80), (80, 120), (128, 48), (48, 128), (100, 80)]


def make_bucket_tars(tars, counts: list[int]) -> tuple[str, int]:
    """Tars of ``counts[n]`` captioned JPEGs each, sample ``i`` of ``SOURCE_SIZES[i % 6]``; their pattern and
    the sample count."""
    start = 0
    for number, count in enumerate(counts):
        members = []
        for index in range(start, start + count):
            width, height = SOURCE_SIZES[index % len(SOURCE_SIZES)]
            members += [Member(f"{index:06d}.jpg", jpeg_bytes(index_image(index, width, height))),
                        Member(f"{index:06d}.txt", f"caption {index}".encode())]
        tars.write(f"{number:02d}.tar", members)
        start += count
    return f"{tars.directory}/*.tar", start


def run_bucket_job(*args: str):
    """``preprocess run ARGS`` with the bucketed flags, in-process."""
    return runner.invoke(app, ["run", *args, *BUCKET_FLAGS, "-q"], catch_exceptions=False)


def check_buckets(out: str, samples: int) -> dict[int, int]:
    """Every sample once, each in a shard of its nearest bucket's shape; samples per bucket."""
    ds = shardio.open_dataset(out, verify=True)
    assert [tuple(b) for b in ds.buckets] == JOB_BUCKETS
    with open(os.path.join(out, "manifest.json"), encoding="utf-8") as f:
        root = json.load(f)
    assert root["format_version"] == 4 and root["buckets"] == [list(b) for b in JOB_BUCKETS]
    assert root["versions"]["format_version"] == 4  # what the run wrote, as `shardio info` shows it
    assert root["config"]["buckets"] == root["buckets"] and root["shape"] == [32, 32, 3]
    seen: list[int] = []
    per_bucket: dict[int, int] = {}
    for shard in range(len(ds.shards)):
        bucket = int(ds.shard_buckets[shard])
        assert ds.shard_shape(shard) == JOB_BUCKETS[bucket]
        entry = ds.shards[shard]
        assert entry.bucket == bucket
        decoded = [np.asarray(p) for p in ds.pixels(shard)]
        with open(os.path.join(out, entry.meta_path), encoding="utf-8") as f:
            lines = [json.loads(line) for line in f]
        assert len(lines) == len(decoded) == entry.samples
        for image, line in zip(decoded, lines):
            key = line["key"]
            assert image.shape == (*JOB_BUCKETS[bucket], 3)
            index = int(key)
            assert decode_index(image) == index
            width, height = SOURCE_SIZES[index % len(SOURCE_SIZES)]
            assert (line["width"], line["height"]) == (width, height)
            assert nearest_bucket(width, height, JOB_BUCKETS) == bucket, f"sample {key} in the wrong bucket"
            seen.append(index)
        per_bucket[bucket] = per_bucket.get(bucket, 0) + len(decoded)
    assert sorted(seen) == list(range(samples)), "a sample is missing or duplicated"
    return per_bucket
