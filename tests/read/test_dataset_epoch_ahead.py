"""No wait at an epoch's start: iterated epoch after epoch, the prefetch thread assembles the next epoch's
first batches while the last ones of this epoch are still to be handed out, and the next epoch takes them;
anything that changes the next pass (``set_epoch``, a loaded state) drops them. Nothing here is timed: the
consumer waits for the thread's recorded events before it takes the epoch's last batch."""

from __future__ import annotations

import gc
import threading

import numpy as np
import pytest
from dataset_fixtures import indices, make_dataset

from shardio import ShardDataset
from shardio.read.batches import BatchAssembler
from shardio.read.prefetch import Prefetcher

WAIT_S = 60  # an event that does not come within this is a failure, not a slow machine


@pytest.fixture(scope="module")
def dataset_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    directory = str(tmp_path_factory.mktemp("epoch-ahead"))
    make_dataset(directory)  # 117 samples: 12 batches of 10, the last one of 7
    return directory


class Assembled:
    """Every batch the assembler makes, in order, by its samples' indices; ``wait_for(order)`` waits until a
    batch of exactly these samples was made."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.batches: list[tuple[int, ...]] = []
        self.changed = threading.Condition()
        assemble = BatchAssembler.assemble

        def recorded(assembler, *args, **kwargs):
            batch = assemble(assembler, *args, **kwargs)
            with self.changed:
                self.batches.append(tuple(indices(batch).tolist()))
                self.changed.notify_all()
            return batch

        monkeypatch.setattr(BatchAssembler, "assemble", recorded)

    def wait_for(self, samples: np.ndarray) -> None:
        wanted = tuple(samples.tolist())
        with self.changed:
            assert self.changed.wait_for(lambda: wanted in self.batches, WAIT_S), "never assembled"

    def count(self, samples: np.ndarray) -> int:
        with self.changed:
            return self.batches.count(tuple(samples.tolist()))


@pytest.fixture
def assembled(monkeypatch: pytest.MonkeyPatch) -> Assembled:
    return Assembled(monkeypatch)


def epochs_order(ds: ShardDataset, epoch: int) -> np.ndarray:
    return ds.sample_order(epoch)


@pytest.mark.parametrize("prefetch", [1, 2, 3])
def test_the_next_epochs_first_batch_is_assembled_before_this_epochs_last_is_handed_out(
        dataset_dir: str, assembled: Assembled, prefetch: int) -> None:
    ds = ShardDataset(dataset_dir, 10, shuffle=True, seed=4, prefetch=prefetch)
    reference = ShardDataset(dataset_dir, 10, shuffle=True, seed=4, prefetch=0)
    next_first = epochs_order(ds, 1)[:10]
    batches = iter(ds)
    got = [indices(next(batches)) for _ in range(len(ds) - 1)]
    assembled.wait_for(next_first)  # epoch 1's first batch, made while epoch 0's last is still to come
    got.append(indices(next(batches)))
    assert (np.concatenate(got) == epochs_order(ds, 0)).all()
    # The state counts what was handed out, not what the thread made ahead: as a dataset without a thread.
    for _ in reference:
        pass
    assert ds.state_dict() == reference.state_dict()
    with pytest.raises(StopIteration):
        next(batches)
    assert ds.state_dict() == reference.state_dict()
    second = np.concatenate([indices(b) for b in ds])
    assert (second == epochs_order(ds, 1)).all()
    assert assembled.count(next_first) == 1, "the next epoch assembled its first batch again"


def test_set_epoch_drops_what_was_made_ahead(dataset_dir: str, assembled: Assembled) -> None:
    ds = ShardDataset(dataset_dir, 10, shuffle=True, seed=4)
    for _ in ds:
        pass
    assembled.wait_for(epochs_order(ds, 1)[:10])
    ds.set_epoch(5)
    assert (np.concatenate([indices(b) for b in ds]) == epochs_order(ds, 5)).all()
    assert ds.epoch == 5
    assert (np.concatenate([indices(b) for b in ds]) == epochs_order(ds, 6)).all()


def test_a_state_loaded_between_epochs_resumes_exactly(dataset_dir: str, assembled: Assembled) -> None:
    """A state loaded after an epoch (its thread made epoch 1's first batches) names where the next
    pass starts: mid-epoch 3 of another run, not epoch 1."""
    other = ShardDataset(dataset_dir, 10, shuffle=True, seed=4)
    other.set_epoch(3)
    taken = iter(other)
    head = [indices(next(taken)) for _ in range(4)]
    state = other.state_dict()
    ds = ShardDataset(dataset_dir, 10, shuffle=True, seed=4)
    for _ in ds:
        pass
    assembled.wait_for(epochs_order(ds, 1)[:10])
    ds.load_state_dict(state)
    rest = [indices(b) for b in ds]
    assert (np.concatenate(head + rest) == epochs_order(ds, 3)).all()
    del taken


def test_a_dataset_dropped_after_its_last_epoch_leaves_no_thread(dataset_dir: str, assembled: Assembled) -> None:
    ds = ShardDataset(dataset_dir, 10, shuffle=True, prefetch=2)
    for _ in ds:
        pass
    ds._passes.join_ahead()  # two batches of epoch 1, then the thread ends by itself
    assert not [t for t in threading.enumerate() if t.name == "shardio-prefetch"]
    assert not Prefetcher.live
    assert assembled.count(epochs_order(ds, 1)[:10]) == 1 and len(assembled.batches) == len(ds) + 2


def test_an_epoch_shorter_than_the_prefetch_depth(dataset_dir: str) -> None:
    ds = ShardDataset(dataset_dir, 50, shuffle=True, seed=1, prefetch=4)  # 3 batches an epoch
    for epoch in range(4):
        assert (np.concatenate([indices(b) for b in ds]) == epochs_order(ds, epoch)).all()


def test_a_consumer_that_stops_at_the_epochs_length_keeps_what_was_begun(dataset_dir: str,
                                                                         assembled: Assembled) -> None:
    """Lightning takes ``len(loader)`` batches and never asks for the end: dropping the iterator then must
    not drop the next epoch's batches."""
    ds = ShardDataset(dataset_dir, 10, shuffle=True, seed=6)
    batches = iter(ds)
    first = [indices(next(batches)) for _ in range(len(ds))]
    del batches
    gc.collect()
    assert (np.concatenate(first) == epochs_order(ds, 0)).all()
    assert (np.concatenate([indices(b) for b in ds]) == epochs_order(ds, 1)).all()
    assert assembled.count(epochs_order(ds, 1)[:10]) == 1, "the next epoch assembled its first batch again"


def test_a_pass_begun_again_while_the_next_one_is_still_chosen_is_not_the_next_one(monkeypatch) -> None:
    """Pass B, claimed from A's look-ahead, ends; its thread is still asking ``ahead()`` which pass follows when
    the consumer begins B once more (``set_epoch`` of the same epoch): B's key must not claim what the thread
    is about to begin (C). The thread is held inside ``ahead()`` until the consumer has chosen."""
    from shardio.read.prefetch import PassPrefetch

    gate, armed, calls = threading.Event(), threading.Event(), []
    claim, close = Prefetcher.claim, Prefetcher.close

    def chose_then_release(real):
        def chosen(prefetcher):
            if armed.is_set():  # the consumer chose (claimed or dropped): the thread may finish choosing now
                gate.set()
            return real(prefetcher)
        return chosen

    monkeypatch.setattr(Prefetcher, "claim", chose_then_release(claim))
    monkeypatch.setattr(Prefetcher, "close", chose_then_release(close))

    def ahead():
        calls.append(len(calls))
        if len(calls) == 1:
            return "B", iter(["b1", "b2"])
        assert gate.wait(WAIT_S), "the consumer never chose"
        return "C", iter(["c1", "c2"])

    prefetch = PassPrefetch()
    assert list(prefetch.passes("A", lambda: iter(["a1", "a2"]), lambda x: x, 1, ahead)) == ["a1", "a2"]
    prefetch.parked.thread.join(WAIT_S)  # B chosen ahead and its first item made: the thread parked it and ended
    assert list(prefetch.passes("B", lambda: iter(["fresh b1", "fresh b2"]), lambda x: x, 1, ahead)) == ["b1", "b2"]
    armed.set()  # B ended; its thread waits in ahead() until the consumer has chosen the next pass
    again = prefetch.passes("B", lambda: iter(["fresh b1", "fresh b2"]), lambda x: x, 1, ahead)
    assert list(again) == ["fresh b1", "fresh b2"]
