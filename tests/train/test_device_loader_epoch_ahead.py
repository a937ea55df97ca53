"""``DeviceLoader`` iterated epoch after epoch: its prefetch thread prepares (assembles, and moves to the
device) the next epoch's first batches while this epoch's last ones are still to be handed out; the next
epoch takes them, and the state counts only what was handed out. No timing: the consumer waits for the
thread's recorded events before it takes the epoch's last batch."""

from __future__ import annotations

import threading

import pytest
import torch
from dataset_fixtures import make_dataset

from shardio import DeviceLoader, ShardDataset, ShardLoader

WAIT_S = 60


@pytest.fixture(scope="module")
def dataset_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    directory = str(tmp_path_factory.mktemp("device-epochs"))
    make_dataset(directory)  # 117 samples, labels = stored indices
    return directory


class Prepared:
    """The labels of every batch ``DeviceLoader`` prepared, in order."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.batches: list[tuple[int, ...]] = []
        self.changed = threading.Condition()
        prepare = DeviceLoader._prepare

        def recorded(loader, item):
            out = prepare(loader, item)
            with self.changed:
                self.batches.append(tuple(item[0]["cls"].tolist()))
                self.changed.notify_all()
            return out

        monkeypatch.setattr(DeviceLoader, "_prepare", recorded)

    def wait_for(self, labels: list[int]) -> None:
        with self.changed:
            assert self.changed.wait_for(lambda: tuple(labels) in self.batches, WAIT_S), "never prepared"


@pytest.mark.parametrize("wrap", [lambda ds: ds, lambda ds: ShardLoader(ds)], ids=["dataset", "shardloader"])
def test_the_next_epochs_first_batch_is_on_the_device_before_this_epochs_last_is_handed_out(
        dataset_dir: str, monkeypatch: pytest.MonkeyPatch, wrap) -> None:
    prepared = Prepared(monkeypatch)
    ds = ShardDataset(dataset_dir, 10, shuffle=True, seed=2)
    reference = ShardDataset(dataset_dir, 10, shuffle=True, seed=2, prefetch=0)
    loader = DeviceLoader(wrap(ds), "cpu")
    order = [ds.sample_order(epoch).tolist() for epoch in range(2)]
    batches = iter(loader)
    got = [next(batches)["cls"] for _ in range(len(ds) - 1)]
    prepared.wait_for(order[1][:10])  # epoch 1's first batch, while epoch 0's last is still to come
    got.append(next(batches)["cls"])
    assert torch.cat(got).tolist() == order[0]
    for _ in reference:
        pass
    assert loader.state_dict() == reference.state_dict()  # what was handed out, not what was made ahead
    with pytest.raises(StopIteration):
        next(batches)
    second = torch.cat([batch["cls"] for batch in loader]).tolist()
    assert second == order[1]
    assert prepared.batches.count(tuple(order[1][:10])) == 1, "the next epoch prepared its first batch again"


def test_resuming_a_device_loader_between_epochs_is_exact(dataset_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    prepared = Prepared(monkeypatch)
    ds = ShardDataset(dataset_dir, 10, shuffle=True, seed=2)
    loader = DeviceLoader(ds, "cpu", prefetch=3)
    for _ in loader:
        pass
    prepared.wait_for(ds.sample_order(1)[:10].tolist())
    state = loader.state_dict()
    resumed = DeviceLoader(ShardDataset(dataset_dir, 10, shuffle=True, seed=2), "cpu")
    resumed.load_state_dict(state)
    assert torch.cat([b["cls"] for b in resumed]).tolist() == ds.sample_order(1).tolist()
    assert torch.cat([b["cls"] for b in loader]).tolist() == ds.sample_order(1).tolist()
