"""The loop never waits on a copy: iterated in the main process (alone or through a plain
``DataLoader(ds, batch_size=None)``), batches are assembled ahead on a background thread; the thread
stops when the iterator is dropped or raises, and its errors reach the caller as themselves; at an epoch's
end it assembles the next epoch's first batches, then ends by itself."""

from __future__ import annotations

import gc
import os
import threading

import numpy as np
import pytest
from dataset_fixtures import indices, make_dataset
from layout_fixtures import LayoutDataset
from torch.utils.data import DataLoader

from shardio import ShardDataset, ShardFormatError, ShardLoader
from shardio.read.batches import BatchAssembler
from shardio.read.prefetch import Prefetcher


@pytest.fixture(scope="module")
def dataset_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    directory = str(tmp_path_factory.mktemp("prefetch"))
    make_dataset(directory)
    return directory


def prefetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "shardio-prefetch" and t.is_alive()]


@pytest.fixture
def assembling_threads(monkeypatch) -> list[str]:
    names: list[str] = []
    assemble = BatchAssembler.assemble

    def recorded(self, *args, **kwargs):
        names.append(threading.current_thread().name)
        return assemble(self, *args, **kwargs)

    monkeypatch.setattr(BatchAssembler, "assemble", recorded)
    return names


@pytest.mark.parametrize("wrap", [lambda ds: ds, lambda ds: DataLoader(ds, batch_size=None),
                                  lambda ds: ShardLoader(ds)], ids=["alone", "dataloader", "shardloader"])
def test_batches_are_assembled_on_the_prefetch_thread(dataset_dir: str, assembling_threads, wrap) -> None:
    ds = ShardDataset(dataset_dir, 10, shuffle=True)
    order = np.concatenate([indices(b) for b in wrap(ds)])
    assert (order == ds.sample_order(0)).all()
    ds._passes.join_ahead()  # the next epoch's first two batches, then the thread ends by itself
    assert len(assembling_threads) == len(ds) + 2 and set(assembling_threads) == {"shardio-prefetch"}
    assert not prefetch_threads() and not Prefetcher.live


def test_prefetch_zero_assembles_in_the_callers_thread(dataset_dir: str, assembling_threads) -> None:
    list(ShardDataset(dataset_dir, 10, prefetch=0))
    assert set(assembling_threads) == {threading.current_thread().name}


def test_the_thread_runs_ahead_and_state_counts_only_what_was_handed_out(dataset_dir: str) -> None:
    ds = ShardDataset(dataset_dir, 10, prefetch=3)
    batches = iter(ds)
    next(batches)
    assert ds.state_dict()["batches_seen"] == 1  # three more are ready, none handed out
    resumed = ShardDataset(dataset_dir, 10)
    resumed.load_state_dict(ds.state_dict())
    assert (np.concatenate([indices(b) for b in resumed]) == np.arange(10, 117)).all()
    del batches


def test_dropping_the_iterator_stops_the_thread(dataset_dir: str) -> None:
    batches = iter(DataLoader(ShardDataset(dataset_dir, 4, shuffle=True), batch_size=None))
    next(batches)
    assert prefetch_threads()
    del batches
    gc.collect()
    assert not prefetch_threads() and not Prefetcher.live


def test_an_error_reaches_the_caller_and_stops_the_thread(tmp_path) -> None:
    directory = str(tmp_path)
    make_dataset(directory, (24,))
    meta = os.path.join(directory, sorted(p for p in _shard_files(directory) if p.endswith(".jsonl"))[1])
    with open(meta, "r+b") as f:  # same size, one byte broken: found when that shard is first read
        f.seek(0)
        f.write(b"#")
    batches = iter(DataLoader(ShardDataset(directory, 4), batch_size=None))
    got = [indices(next(batches)) for _ in range(2)]  # shard 0 reads fine
    with pytest.raises(ShardFormatError, match=r"\.jsonl: line 1 \(sample 0\): invalid JSON"):
        next(batches)
    assert (np.concatenate(got) == np.arange(8)).all()
    gc.collect()
    assert not prefetch_threads() and not Prefetcher.live


def _shard_files(directory: str) -> list[str]:
    return [os.path.join("shards", name) for name in os.listdir(os.path.join(directory, "shards"))]


def test_shard_loader_pin_memory_without_cuda_is_a_no_op_like_dataloaders(dataset_dir: str) -> None:
    ds = ShardDataset(dataset_dir, 10)
    got = np.concatenate([indices(b) for b in ShardLoader(ds, pin_memory=True)])
    assert (got == np.arange(117)).all()


def test_buffers_are_reused_whatever_the_batchs_shape(layout_dataset: LayoutDataset) -> None:
    ds = ShardDataset(layout_dataset.path, 4, shuffle=True, prefetch=0)
    for _ in range(2):
        for batch in ds:
            del batch
    pool = ds._assembler.buffers
    assert pool.allocations <= pool.size  # made once, then reused whatever the bucket
