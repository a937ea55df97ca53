"""A dataset's place is opened once: its backend is chosen when ``ShardDataset`` (or ``open_dataset``) opens
the root, and nothing below asks again, however many shards it has."""

from __future__ import annotations

import pytest

from shardio.read.dataset import ShardDataset
from shardio.read.snapshot import open_dataset
from shardio.store import backends
from tests.dataset_fixtures import make_dataset
from tests.read.test_reader_s3 import upload


def _choices(patch: pytest.MonkeyPatch) -> list[str]:
    """The paths the backend table is asked about while ``patch`` holds (every ``for_path`` asks ``scheme``)."""
    asked: list[str] = []
    scheme = backends.scheme
    patch.setattr(backends, "scheme", lambda path: asked.append(path) or scheme(path))
    return asked


@pytest.mark.parametrize("opening", ["open_dataset", "ShardDataset"])
def test_the_backend_is_chosen_once_whatever_the_shard_count(tmp_path, monkeypatch, opening):
    chosen = {}
    for shards in (10, 100):
        directory = str(tmp_path / f"ds{shards}")
        make_dataset(directory, (4 * shards,), samples_per_shard=4)
        with monkeypatch.context() as patch:
            asked = _choices(patch)
            if opening == "open_dataset":
                assert len(open_dataset(directory).shards) == shards
            else:
                dataset = ShardDataset(directory, 4)
                assert sum(len(batch["cls"]) for batch in dataset) == 4 * shards  # every shard read
        chosen[shards] = asked
    assert chosen[10] == [str(tmp_path / "ds10")] and chosen[100] == [str(tmp_path / "ds100")]


def test_a_dataset_in_a_bucket_chooses_its_backend_once_whatever_the_shard_count(s3_server, s3_bucket, tmp_path,
                                                                                   monkeypatch):
    chosen = {}
    for shards in (3, 12):
        local = str(tmp_path / f"local{shards}")
        make_dataset(local, (4 * shards,), samples_per_shard=4)
        url = upload(s3_server, s3_bucket, local, prefix=f"once{shards}")
        with monkeypatch.context() as patch:
            asked = _choices(patch)
            dataset = ShardDataset(url, 4, cache_dir=str(tmp_path / f"cache{shards}"))
            assert sum(len(batch["cls"]) for batch in dataset) == 4 * shards  # every shard downloaded and read
        chosen[shards] = asked
    assert chosen[3] == [f"s3://{s3_bucket}/once3"] and chosen[12] == [f"s3://{s3_bucket}/once12"]
