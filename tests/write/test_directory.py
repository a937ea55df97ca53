"""``shardio.write.directory`` as the one owner of a dataset directory, without Ray: one shard checker for the
reader, ``verify`` and restore; the commit from plain values; staged files through the directory."""

from __future__ import annotations

import os

import numpy as np
import pytest

import shardio
from preprocess.verify import verify_dataset
from shardio.write import directory as dataset_dir
from shardio.errors import ShardIntegrityError
from shardio.format.manifests import load_manifest
from shardio.write.shard_writer import InputShardWriter
from tests.dataset_fixtures import make_dataset


@pytest.mark.parametrize("encoding", ["raw", "jpeg"])
@pytest.mark.parametrize("damage", ["truncate", "remove", "flip"])
def test_the_reader_and_verify_name_a_bad_shard_with_the_same_words(tmp_path, damage, encoding):
    out = str(tmp_path / "ds")
    manifest = make_dataset(out, inputs=(12, 5), encoding=encoding)
    entry = manifest.shards[1]
    assert entry.path.endswith(".jpg.npy" if encoding == "jpeg" else ".npy")
    path = os.path.join(out, entry.path)
    if damage == "truncate":
        os.truncate(path, entry.bytes - 3)
    elif damage == "remove":
        os.remove(path)
    else:
        with open(path, "r+b") as f:
            f.seek(200)
            f.write(b"\xff\x00\xff")
    bad = verify_dataset(out).bad
    assert [b.shard for b in bad] == [entry.path] and bad[0].input == entry.input
    with pytest.raises(ShardIntegrityError) as caught:
        shardio.open_dataset(out, verify=True)
    assert bad[0].problem in str(caught.value)  # one checker, one wording, the full path in both
    assert path in bad[0].problem


def test_a_commit_from_plain_values_lists_the_input_and_retires_its_old_shards(tmp_path):
    out = str(tmp_path / "ds")
    manifest = make_dataset(out, inputs=(10,))
    old_shards = list(manifest.inputs["input-0.tar"].shards)
    writer = InputShardWriter(out, "input-0-v2", 8, 8, 4)
    for i in range(6):
        writer.add(np.full((8, 8, 3), i, np.uint8), {"key": f"v2-{i}"}, "input-0.tar")
    shards = [vars(e) for e in writer.close("input-0.tar")]  # dicts, as a Ray task returns them

    with dataset_dir.writing(out):
        committer = dataset_dir.Committer(out, load_manifest(out))
        committer.add_input("input-0.tar", size=123, mtime_ns=456, shards=shards, failed=2)
        committer.maybe_commit(force=True)
    committed = load_manifest(out)
    entry = committed.inputs["input-0.tar"]
    assert (entry.size, entry.mtime_ns, entry.samples, entry.failed) == (123, 456, 6, 2)
    assert [s.path for s in committed.shards] == entry.shards == ["shards/input-0-v2-00000.npy",
                                                                  "shards/input-0-v2-00001.npy"]
    assert {r.path for r in committed.retired} >= set(old_shards)  # kept for older generations' readers
    assert all(os.path.exists(os.path.join(out, p)) for p in old_shards)
    assert len(shardio.open_dataset(out)) == 6


def test_an_aborted_writer_leaves_nothing_in_the_directory(tmp_path):
    out = str(tmp_path / "ds")
    os.makedirs(out)
    writer = InputShardWriter(out, "input-0", 8, 8, 4)
    for i in range(6):
        writer.add(np.full((8, 8, 3), i, np.uint8), {"key": str(i)}, "input-0.tar")
    writer.abort()
    assert os.listdir(os.path.join(out, "shards")) == []
    assert dataset_dir.clean_leftovers(out, None).removed == 0
