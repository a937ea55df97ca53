"""The tools on a bucketed dataset: ``preprocess verify`` checks each shard at its bucket's size (and the
steps of ``--repair`` that are the format's: dropping the bad inputs, restoring a corrupt root), and
``shardio info`` shows the bucket histogram, as text and as JSON."""

from __future__ import annotations

import json
import os

import pytest
from typer.testing import CliRunner

from bucket_fixtures import BUCKETS, make_bucketed_dataset, swap_shard_buckets
from preprocess.cli import app as preprocess_app
from preprocess.verify import verify_dataset
from shardio.errors import ShardIntegrityError
from shardio.format.manifests import load_index, load_manifest
from shardio.read.snapshot import open_dataset
from shardio.tools.cli import app
from shardio.write import directory as dataset_dir

SAMPLES = (20, 27, 13)


@pytest.fixture(params=["raw", "jpeg"])
def bucketed(tmp_path, request) -> str:
    return make_bucketed_dataset(str(tmp_path / "ds"), BUCKETS, SAMPLES, encoding=request.param)


def test_verify_finds_a_damaged_shard_in_each_bucket_and_nothing_in_a_whole_dataset(bucketed):
    assert verify_dataset(bucketed).bad == []
    manifest = load_manifest(bucketed)
    truncated = next(e for e in manifest.shards if e.bucket == 0)
    corrupt = next(e for e in manifest.shards if e.bucket == 2)
    os.truncate(os.path.join(bucketed, truncated.path), truncated.bytes - 5)
    with open(os.path.join(bucketed, corrupt.path), "r+b") as f:
        f.seek(corrupt.bytes - 10)
        f.write(b"\x00\xff\x00")
    result = verify_dataset(bucketed)
    assert {b.shard: b.input for b in result.bad} == {truncated.path: truncated.input, corrupt.path: corrupt.input}
    problems = {b.shard: b.problem for b in result.bad}
    assert f"{truncated.bytes - 5} bytes, the manifest says {truncated.bytes}" in problems[truncated.path]
    assert "differs from the manifest (corrupt)" in problems[corrupt.path]


def test_a_listed_size_that_is_not_the_buckets_is_inconsistent(tmp_path):
    """A raw shard's size follows from its samples and its bucket's shape: a root edited to move a shard
    to another bucket of another size is caught by the size check alone."""
    out = make_bucketed_dataset(str(tmp_path / "ds"), ((8, 8), (4, 4)), (8, 8), inputs=1)

    def forge(arrays):
        arrays["shard_bucket"] = 1 - arrays["shard_bucket"]

    from tests.bucket_fixtures import rewrite_segment

    rewrite_segment(out, forge)
    problems = [b.problem for b in verify_dataset(out).bad]
    assert problems and all("samples imply" in p and "(inconsistent)" in p for p in problems)


@pytest.mark.parametrize("encoding", ["raw", "jpeg"])
def test_verify_names_a_shard_whose_bucket_id_was_swapped_to_one_of_the_same_size(tmp_path, encoding):
    """8x16 and 16x8 shards have the same sizes (raw) and any size passes (JPEG): only each shard's header (a
    raw .npy's shape, a JPEG's frame size) tells that the index lists it in the other bucket."""
    shapes = ((8, 16), (16, 8))
    out = make_bucketed_dataset(str(tmp_path / "ds"), shapes, (9, 7), inputs=1, encoding=encoding)
    true_bucket = {e.path: e.bucket for e in load_index(out).shards}
    swap_shard_buckets(out, 0, 1)
    problems = {b.shard: b.problem for b in verify_dataset(out).bad}
    assert set(problems) == set(true_bucket), problems
    for path, bucket in true_bucket.items():
        (h, w), (forged_h, forged_w) = shapes[bucket], shapes[1 - bucket]
        said = problems[path]
        assert path in said and f"{h}x{w}" in said, said
        assert f"bucket {1 - bucket} ({forged_h}x{forged_w})" in said, said
    result = CliRunner().invoke(preprocess_app, ["verify", out])
    said = " ".join(result.output.split())
    assert result.exit_code == 1, result.output
    assert said.count("BAD ") == len(true_bucket) and "--repair" in said, result.output

    snapshot = open_dataset(out)  # sizes agree: the reader finds it at the first read of the shard
    for shard, entry in enumerate(snapshot.shards):
        with pytest.raises(ShardIntegrityError) as refused:
            snapshot.check(shard)
            snapshot.pixels(shard)[0]
        said = str(refused.value)
        assert entry.path in said and "`preprocess verify DIR --repair` to rebuild it from its input" in said


def test_dropping_inputs_and_restoring_a_root_keep_a_bucketed_dataset(bucketed):
    dataset_dir.drop_inputs(bucketed, ["input-1.tar"])
    index = load_index(bucketed)
    assert index.format_version == 4 and {e.input for e in index.shards} == {"input-0.tar"}
    assert index.shards.bucket_ids().tolist() == [e.bucket for e in index.shards]
    with open(os.path.join(bucketed, "manifest.json"), "w") as f:
        f.write("{not json")
    restored = dataset_dir.restore_manifest(bucketed)
    assert restored is not None and restored.buckets == BUCKETS
    snapshot = open_dataset(bucketed, verify=True)
    assert snapshot.is_bucketed and len(snapshot) == sum(e.samples for e in index.shards)
    assert json.load(open(os.path.join(bucketed, "manifest.json")))["format_version"] == 4


def test_info_shows_the_bucket_histogram_as_text_and_json(bucketed):
    manifest = load_manifest(bucketed)
    result = CliRunner().invoke(app, ["info", bucketed, "--json"], prog_name="shardio")
    assert result.exit_code == 0, result.output
    info = json.loads(result.stdout)
    assert [b["shape"] for b in info["buckets"]] == [list(b) for b in BUCKETS]
    assert [b["samples"] for b in info["buckets"]] == list(SAMPLES)
    for b in info["buckets"]:
        mine = [e for e in manifest.shards if e.bucket == b["bucket"]]
        assert b["shards"] == len(mine) and b["bytes"] == sum(e.bytes for e in mine)
    if info["encoding"] == "raw":
        assert info["raw_bytes_per_image"] == pytest.approx(info["bytes_per_image"], rel=0.2)
    result = CliRunner().invoke(app, ["info", bucketed], prog_name="shardio")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("buckets"))
    assert lines[at].startswith("buckets      3 shapes")
    for (h, w), count, line in zip(BUCKETS, SAMPLES, lines[at + 1:at + 4]):
        assert f"{h}x{w}" in line.replace(" ", "") and f" {count} samples" in line


def test_info_shows_every_bucket_aspect_even_the_extreme_ones(tmp_path):
    """8192x1 and 8192x8 are valid buckets (sides 1..8192): their aspect must not print as 0."""
    shapes = ((8192, 1), (8192, 8), (16, 16), (12, 20), (1, 8192))
    out = make_bucketed_dataset(str(tmp_path / "ds"), shapes, (1, 1, 1, 1, 1), inputs=1)
    result = CliRunner().invoke(app, ["info", out], prog_name="shardio")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("buckets"))
    assert "w:h" in lines[at]
    rows = [" ".join(line.split()) for line in lines[at + 1:at + 1 + len(shapes)]]
    for (h, w), ratio, row in zip(shapes, ("1:8192", "1:1024", "1:1", "1.67:1", "8192:1"), rows):
        assert row.split()[1:3] == [f"{h}x{w}", ratio], row


def test_info_of_a_single_shape_dataset_has_no_buckets(tmp_path):
    from dataset_fixtures import make_dataset

    out = str(tmp_path / "plain")
    make_dataset(out, (5,))
    result = CliRunner().invoke(app, ["info", out, "--json"], prog_name="shardio")
    assert result.exit_code == 0 and "buckets" not in json.loads(result.stdout)


