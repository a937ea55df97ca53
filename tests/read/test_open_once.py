"""A dataset's place is opened once: its backend is chosen when ``ShardDataset`` (or ``open_dataset``) opens
the root, and nothing below asks again, however many shards it has."""

from __future__ import annotations

import pytest

from shardio.read.dataset import ShardDataset
from shardio.read.snapshot import open_dataset
from shardio.store import backends
from tests.dataset_fixtures import make_dataset


def _choices(monkeypatch) -> list[str]:
    """The paths the backend table is asked about from now on (every ``for_path`` asks ``scheme``)."""
    asked: list[str] = []
    scheme = backends.scheme
    monkeypatch.setattr(backends, "scheme", lambda path: asked.append(path) or scheme(path))
    return asked


@pytest.mark.parametrize("opening", ["open_dataset", "ShardDataset"])
def test_the_backend_is_chosen_once_whatever_the_shard_count(tmp_path, monkeypatch, opening):
    chosen = {}
    for shards in (10, 100):
        directory = str(tmp_path / f"ds{shards}")
        make_dataset(directory, (4 * shards,), samples_per_shard=4)
        asked = _choices(monkeypatch)
        if opening == "open_dataset":
            assert len(open_dataset(directory).shards) == shards
        else:
            dataset = ShardDataset(directory, 4)
            assert sum(len(batch["cls"]) for batch in dataset) == 4 * shards
        chosen[shards] = list(asked)
        monkeypatch.undo()
    assert chosen[10] == [str(tmp_path / "ds10")] and chosen[100] == [str(tmp_path / "ds100")]
