"""``encoding: yuv420`` end to end through the job (Ray): one shape, buckets and ``mode: pad`` give version 5
datasets whose every sample reads back once as its index colour; ``verify`` names a flipped byte and
``--repair`` rebuilds the same bytes; ``shardio info`` and ``preview`` read it."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from typer.testing import CliRunner

import shardio
from preprocess.cli import app
from shardio import ShardDataset
from shardio.format.yuv_shard import yuv420_to_rgb, yuv_shard_nbytes
from shardio.tools.cli import main as shardio_main
from tests.dataset_compare import assert_clean, dataset_state
from tests.dataset_fixtures import flip_bits
from preprocess.image.buckets import nearest_bucket
from tests.bucket_jobs import JOB_BUCKETS as BUCKETS
from tests.bucket_jobs import SOURCE_SIZES as SIZES
from tests.bucket_jobs import make_bucket_tars as make_tars
from tests.bucket_jobs import BUCKET_FLAGS
from tests.tar_factory import decode_index

pytestmark = pytest.mark.ray
runner = CliRunner()


def run(*args: str):
    return runner.invoke(app, ["run", *args, "--encoding", "yuv420", "-q"], catch_exceptions=False)


def root_of(out: str) -> dict:
    with open(os.path.join(out, "manifest.json"), encoding="utf-8") as f:
        return json.load(f)


def read_all(out: str) -> dict[int, np.ndarray]:
    """Every sample's image by its index (the tars' flat colours), each read once, checked against the
    conversion of its stored planes."""
    ds = shardio.open_dataset(out, verify=True)
    found: dict[int, np.ndarray] = {}
    for shard in range(len(ds.shards)):
        entry, (height, width) = ds.shards[shard], ds.shard_shape(shard)
        path = os.path.join(out, entry.path)
        assert path.endswith(".yuv.npy") and os.path.getsize(path) == yuv_shard_nbytes(entry.samples, height, width)
        planes = np.load(path)
        images = np.asarray(ds.pixels(shard))
        assert np.array_equal(images, yuv420_to_rgb(planes, height, width))
        with open(os.path.join(out, entry.meta_path), encoding="utf-8") as f:
            keys = [int(json.loads(line)["key"]) for line in f]
        for key, image in zip(keys, images):
            assert key not in found, f"sample {key} twice"
            assert decode_index(image) == key
            found[key] = image
    return found


def test_one_shape_verify_names_a_flipped_byte_and_repair_rebuilds_it(ray_cluster, tars, tmp_path, capsys):
    pattern, samples = make_tars(tars, [11, 6])
    out = str(tmp_path / "out")
    result = run(pattern, "--output", out, "--size", "24", "--samples-per-shard", "4")
    assert result.exit_code == 0, result.output
    root = root_of(out)
    assert root["format_version"] == 5 and root["versions"]["format_version"] == 5 and "buckets" not in root
    assert root["config"]["encoding"] == "yuv420" and "quality" not in root["config"]
    assert sorted(read_all(out)) == list(range(samples))
    batches = list(ShardDataset(out, 5, shuffle=True, seed=0))
    assert sorted(i for b in batches for i in b["__key__"]) == [f"{i:06d}" for i in range(samples)]
    assert all(tuple(b["image"].shape[1:]) == (24, 24, 3) for b in batches)

    before = dataset_state(out)
    bad = before["shards"][1]
    flip_bits(os.path.join(out, bad["path"]), 128 + 300, 0x04)
    checked = runner.invoke(app, ["verify", out])
    assert checked.exit_code == 1 and bad["path"] in checked.output, checked.output
    repaired = runner.invoke(app, ["verify", out, "--repair"])
    assert repaired.exit_code == 0, repaired.output
    after = dataset_state(out)
    assert after["shards"] == before["shards"] and after["files"] == before["files"], "not rebuilt byte for byte"
    assert_clean(out)

    assert shardio_main(["info", out, "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["encoding"] == "yuv420" and info["samples"] == samples
    assert info["raw_bytes_per_image"] / info["bytes_per_image"] > 1.9  # 1.5 bytes a pixel, headers aside
    png = tmp_path / "preview.png"
    assert shardio_main(["preview", out, "--out", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_buckets_put_each_sample_once_in_a_shard_of_its_bucket(ray_cluster, tars, tmp_path):
    pattern, samples = make_tars(tars, [13, 9])
    out = str(tmp_path / "out")
    result = runner.invoke(app, ["run", pattern, "--output", out, *BUCKET_FLAGS, "--encoding", "yuv420", "-q"],
                           catch_exceptions=False)
    assert result.exit_code == 0, result.output
    root = root_of(out)
    assert root["format_version"] == 5 and root["buckets"] == [list(b) for b in BUCKETS]
    assert sorted(read_all(out)) == list(range(samples))
    snapshot = shardio.open_dataset(out)
    for shard in range(len(snapshot.shards)):  # each shard in the bucket nearest its samples' aspect
        with open(os.path.join(out, snapshot.shards[shard].meta_path), encoding="utf-8") as f:
            for line in f:
                index = int(json.loads(line)["key"])
                assert nearest_bucket(*SIZES[index % len(SIZES)], BUCKETS) == int(snapshot.shard_buckets[shard])
    ds = ShardDataset(out, 4, shuffle=True, seed=1)
    for batch in ds:
        assert tuple(batch["image"].shape[1:3]) == BUCKETS[batch["bucket"]]
        assert [decode_index(image) for image in batch["image"].numpy()] == [int(k) for k in batch["__key__"]]


def test_pad_mode_keeps_its_content_boxes(ray_cluster, tars, tmp_path):
    pattern, samples = make_tars(tars, [7])
    out = str(tmp_path / "out")
    result = run(pattern, "--output", out, "--size", "32", "--mode", "pad", "--samples-per-shard", "4")
    assert result.exit_code == 0, result.output
    assert root_of(out)["format_version"] == 5
    for batch in ShardDataset(out, 4):
        boxes = batch["content_box"].numpy()
        for image, box, key in zip(batch["image"].numpy(), boxes, batch["__key__"]):
            x0, y0, x1, y1 = box
            assert 0 <= x0 < x1 <= 32 and 0 <= y0 < y1 <= 32
            assert decode_index(image[y0:y1, x0:x1]) == int(key)
