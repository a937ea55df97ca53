"""``preprocess verify`` at scale: the index is read as columns (no ``load_manifest``: an object per shard)
and the shards are checked a chunk at a time, with the same findings at any chunk size, a damaged shard
on either side of a chunk's boundary included. A bucketed dataset's shards are checked each at its bucket's
size and shape (``preprocess verify`` and the reader name a shard listed in another bucket)."""

from __future__ import annotations

import os

import pytest
from typer.testing import CliRunner

from preprocess.cli import app as preprocess_app
from preprocess.verify import verify_dataset
from shardio.errors import ShardIntegrityError
from shardio.format import shard_check
from shardio.format.manifests import load_index, load_manifest
from shardio.read.snapshot import open_dataset
from tests.bucket_fixtures import BUCKETS, make_bucketed_dataset, rewrite_segment, swap_shard_buckets
from tests.dataset_fixtures import flip_bits, make_dataset


@pytest.mark.parametrize("chunk", [1, 2, 3, 4096])
def test_verify_finds_the_same_damaged_shards_at_any_chunk_size_without_an_object_per_shard(
        tmp_path, monkeypatch, chunk):
    out = str(tmp_path / "ds")
    manifest = make_dataset(out, (9, 7, 5), samples_per_shard=2)  # 12 shards in 3 inputs
    damaged = [manifest.shards[1], manifest.shards[2], manifest.shards[-1]]
    for entry in damaged[:2]:
        flip_bits(os.path.join(out, entry.path), 128 + 5)
    os.truncate(os.path.join(out, damaged[2].meta_path), 3)

    def no_objects(*args, **kwargs):
        raise AssertionError("verify loaded the manifest's objects")

    monkeypatch.setattr("shardio.format.manifests.manifest_from_root", no_objects)
    monkeypatch.setattr(shard_check, "_CHUNK", chunk)
    result = verify_dataset(out)
    assert result.shards == len(manifest.shards)
    assert result.bytes == sum(e.bytes + e.meta_bytes for e in manifest.shards)
    assert sorted(b.shard for b in result.bad) == sorted(e.path for e in damaged)
    said = {b.shard: b.problem for b in result.bad}
    assert "differs from the manifest" in said[damaged[0].path] and "bytes, the manifest says" in said[damaged[2].path]
    assert {b.input for b in result.bad} == {damaged[0].input, damaged[2].input}


# --- a bucketed dataset ----------------------------------------------------------------------------------------

@pytest.fixture(params=["raw", "jpeg"])
def bucketed(tmp_path, request) -> str:
    return make_bucketed_dataset(str(tmp_path / "ds"), BUCKETS, (20, 27, 13), encoding=request.param)


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
