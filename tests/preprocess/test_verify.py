"""`preprocess verify`: a flipped bit, a truncated or a missing shard is caught and named; --repair rebuilds only
that input, byte for byte; an input that is gone is named as unrepairable. Each on a dataset of raw pixels,
of yuv420 planes (``.yuv.npy`` shards) and of JPEGs (``encoding: jpeg``, ``.jpg.npy`` shards). A bucketed
dataset's damaged shard, and shards the index lists in a swapped bucket of the same size, are named and
rebuilt."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
from typer.testing import CliRunner

import shardio
from preprocess.cli import app
from shardio.format.jpeg_shard import jpeg_data_start
from shardio.format.yuv_shard import yuv_sample_bytes
from tests.dataset_compare import assert_clean, assert_indices, dataset_state
from tests.dataset_fixtures import flip_bits
from tests.bucket_fixtures import swap_shard_buckets
from tests.bucket_jobs import JOB_BUCKETS, check_buckets, make_bucket_tars, run_bucket_job

pytestmark = pytest.mark.ray
runner = CliRunner()


def verify(out: str, *flags: str):
    return runner.invoke(app, ["verify", out, *flags])


def pixel_byte(path: str, sample: int, samples: int, encoding: str) -> int:
    """The file offset of a byte in the middle of ``sample``'s pixels (raw), planes (yuv420) or JPEG data (jpeg)."""
    if encoding == "raw":
        return 128 + sample * 16 * 16 * 3 + 5
    if encoding == "yuv420":
        return 128 + sample * yuv_sample_bytes(16, 16) + 5
    offsets = np.load(path, mmap_mode="r")  # a JPEG shard's .npy header describes its offsets
    return jpeg_data_start(samples) + int(offsets[sample] + offsets[sample + 1]) // 2


@pytest.fixture
def dataset(ray_cluster, tars, tmp_path, encoding):
    tars.make("a.tar", range(0, 11))
    tars.make("b.tar", range(11, 16))
    out = str(tmp_path / "out")
    result = runner.invoke(app, ["run", f"{tars.directory}/*.tar", "--output", out, "--size", "16",
                                 "--samples-per-shard", "4", "--encoding", encoding, "-q"])
    assert result.exit_code == 0, result.output
    suffix = ".jpg.npy" if encoding == "jpeg" else ".npy"
    assert all(s["path"].endswith(suffix) for s in dataset_state(out)["shards"])
    return out


def test_a_good_dataset_verifies(dataset):
    result = verify(dataset)
    assert result.exit_code == 0, result.output
    assert "5 shard(s)" in result.output and "all match the manifest" in result.output


def test_a_flipped_bit_is_caught_and_repair_rebuilds_only_its_input(dataset, tars, encoding):
    before = dataset_state(dataset)
    bad = before["shards"][1]  # a.tar's second shard
    path = os.path.join(dataset, bad["path"])
    flip_bits(path, pixel_byte(path, 1, bad["samples"], encoding), 0x10)  # its second image
    result = verify(dataset)
    assert result.exit_code == 1, result.output
    bad_lines = [line for line in result.output.splitlines() if line.startswith("BAD")]
    assert len(bad_lines) == 1, result.output
    assert bad["path"] in bad_lines[0] and "xxh3_128 differs" in bad_lines[0] and "a.tar" in bad_lines[0]
    assert "--repair" in result.output

    b_mtimes = {p: os.stat(os.path.join(dataset, p)).st_mtime_ns
                for s in before["shards"] if s["input"].endswith("b.tar") for p in (s["path"],)}
    repaired = verify(dataset, "--repair")
    assert repaired.exit_code == 0, repaired.output
    assert "rebuilt 1 input(s)" in repaired.output and "repaired" in repaired.output
    after = dataset_state(dataset)
    assert after["shards"] == before["shards"] and after["files"] == before["files"], "not rebuilt byte for byte"
    for path, mtime in b_mtimes.items():
        assert os.stat(os.path.join(dataset, path)).st_mtime_ns == mtime, "a good input's shards were rewritten"
    assert_clean(dataset)
    assert_indices(dataset, list(range(16)))


@pytest.mark.parametrize("damage", ["truncate", "remove"])
def test_a_truncated_or_missing_shard_is_named_and_repair_rebuilds_it(dataset, damage):
    before = dataset_state(dataset)
    bad = before["shards"][2]  # a.tar's last, partial shard (3 samples)
    path = os.path.join(dataset, bad["path"])
    if damage == "truncate":
        os.truncate(path, bad["bytes"] - 100)  # the end of its last image's data: only the size tells
    else:
        os.remove(path)
    result = verify(dataset)
    assert result.exit_code == 1, result.output
    said = " ".join(result.output.split())  # rich wraps long lines
    assert "BAD " in said and bad["path"] in said and "a.tar" in said and "--repair" in said
    assert ("bytes, the manifest says" if damage == "truncate" else "missing") in said

    repaired = verify(dataset, "--repair")
    assert repaired.exit_code == 0, repaired.output
    assert "rebuilt 1 input(s)" in repaired.output
    after = dataset_state(dataset)
    assert after["shards"] == before["shards"] and after["files"] == before["files"], "not rebuilt byte for byte"
    assert_clean(dataset)
    assert_indices(dataset, list(range(16)))


def test_repair_names_an_input_that_is_gone(dataset, tars):
    state = dataset_state(dataset)
    b_shard = next(s for s in state["shards"] if s["input"].endswith("b.tar"))
    with open(os.path.join(dataset, b_shard["meta_path"]), "ab") as f:
        f.write(b"{}\n")  # a truncated/overwritten metadata file: the size check catches it
    os.remove(os.path.join(tars.directory, "b.tar"))
    result = verify(dataset, "--repair")
    assert result.exit_code == 1, result.output
    assert "CANNOT REPAIR" in result.output and "b.tar" in result.output and "gone" in result.output
    assert "bytes, the manifest says" in result.output
    shutil.rmtree(dataset)


def test_verify_on_a_missing_dataset_says_so(tmp_path):
    result = verify(str(tmp_path / "nothing"))
    assert result.exit_code == 1
    assert "no such dataset directory" in " ".join(result.output.split())  # rich wraps long paths


# --- mode: bucket --------------------------------------------------------------------------------------------------

def test_verify_names_a_damaged_bucket_shard_and_repair_rebuilds_it(ray_cluster, tars, tmp_path) -> None:
    pattern, samples = make_bucket_tars(tars, [13, 8])
    out = str(tmp_path / "out")
    assert run_bucket_job(pattern, "--output", out).exit_code == 0
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
    pattern, samples = make_bucket_tars(tars, [13, 8])
    out = str(tmp_path / "out")
    assert run_bucket_job(pattern, "--output", out, "--encoding", encoding).exit_code == 0
    before = dataset_state(out)
    wide, tall = JOB_BUCKETS.index((16, 48)), JOB_BUCKETS.index((48, 16))
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
