"""``preprocess verify`` at scale: the index is read as columns (no ``load_manifest``: an object per shard)
and the shards are checked a chunk at a time, with the same findings at any chunk size, a damaged shard
on either side of a chunk's boundary included."""

from __future__ import annotations

import os

import pytest

from preprocess.verify import verify_dataset
from shardio.format import shard_check
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
