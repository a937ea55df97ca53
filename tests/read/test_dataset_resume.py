"""Mid-epoch resume: exactly the batches still to come, standalone and with workers; later epochs fresh;
a batch counts when handed out (``EpochCursor.handed_out``, the one loop every loader uses). A bucketed
dataset's state holds each bucket's position, the same on every rank."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
from bucket_fixtures import make_bucketed_dataset
from dataset_fixtures import indices, make_dataset
from layout_fixtures import READ_BUCKET_SIZES, READ_BUCKETS, LayoutDataset, lockstep

from shardio import DeviceLoader, ShardDataset, ShardLoader
from shardio.read.resume import ORDER_SETTINGS, EpochCursor


@pytest.fixture(scope="module")
def dataset_dir(tmp_path_factory: pytest.TempPathFactory, encoding: str) -> str:
    directory = str(tmp_path_factory.mktemp("resume"))
    make_dataset(directory, encoding=encoding)
    return directory


def make(dataset_dir: str, **kwargs) -> ShardDataset:
    return ShardDataset(dataset_dir, 6, shuffle=True, seed=7, rank=1, world_size=2, **kwargs)


def batches_of(source) -> list[list[int]]:
    return [indices(b).tolist() for b in source]


@pytest.mark.parametrize("stop_after", [0, 1, 4, 9, 10])
def test_resume_standalone(dataset_dir: str, stop_after: int) -> None:
    ds = make(dataset_dir)
    ds.set_epoch(2)
    full = batches_of(ds)
    assert len(full) == len(ds) == 10
    first = make(dataset_dir)
    first.set_epoch(2)
    iterator = iter(first)
    head = [indices(next(iterator)).tolist() for _ in range(stop_after)]
    state = first.state_dict()
    assert state["epoch"] == 2 and state["batches_seen"] == stop_after

    resumed = make(dataset_dir)
    resumed.load_state_dict(state)
    tail = batches_of(resumed)
    if stop_after < len(full):
        assert head + tail == full, "resume repeated, skipped or reordered batches"
    else:  # a finished epoch: the next iteration is the next epoch (as with no resume in between)
        following = make(dataset_dir)
        following.set_epoch(3)
        assert head == full and tail == batches_of(following)
    # The resume point is used once; the next epoch starts fresh.
    resumed.set_epoch(3)
    assert len(batches_of(resumed)) == len(resumed)


def test_resume_with_workers(dataset_dir: str) -> None:
    ds = make(dataset_dir)
    ds.set_epoch(1)
    full = batches_of(ds)
    loader = ShardLoader(make(dataset_dir), num_workers=2)
    loader.dataset.set_epoch(1)
    iterator = iter(loader)
    head = [indices(next(iterator)).tolist() for _ in range(3)]  # workers have prefetched more than 3
    state = loader.state_dict()
    del iterator
    assert state["batches_seen"] == 3

    resumed = ShardLoader(make(dataset_dir), num_workers=2)
    resumed.load_state_dict(state)
    tail = batches_of(resumed)
    assert head + tail == full
    assert resumed.state_dict()["batches_seen"] == len(full)
    assert len(batches_of(resumed)) == len(full), "the same epoch again must not skip a second time"


def test_device_loader_counts_what_it_yielded(dataset_dir: str) -> None:
    loader = DeviceLoader(ShardLoader(make(dataset_dir)), "cpu")
    iterator = iter(loader)
    next(iterator), next(iterator)
    assert loader.state_dict()["batches_seen"] == 2


def test_state_from_other_settings_is_refused(dataset_dir: str) -> None:
    state = make(dataset_dir).state_dict()
    other = ShardDataset(dataset_dir, 6, shuffle=True, seed=8, rank=1, world_size=2)
    with pytest.raises(ValueError, match="seed"):
        other.load_state_dict(state)
    with pytest.raises(ValueError, match="batches_seen"):
        make(dataset_dir).load_state_dict({**state, "batches_seen": 11})
    # Another rank of the same run may load rank 1's state: DDP ranks step in lockstep.
    ShardDataset(dataset_dir, 6, shuffle=True, seed=7, rank=0, world_size=2).load_state_dict(state)


def test_order_identical_after_resume_across_epochs(dataset_dir: str) -> None:
    ds = make(dataset_dir)
    epochs = []
    for epoch in range(2):
        ds.set_epoch(epoch)
        epochs.append(np.concatenate([indices(b) for b in ds]))
    assert not (epochs[0] == epochs[1]).all()


# What shardio's defaults were before order version 2; its states carry no order_version.
OLD_DEFAULTS = {"shuffle_window": 8, "shuffle_block": 16}


def old_run(dataset_dir: str) -> ShardDataset:
    return make(dataset_dir, order_version=1, **OLD_DEFAULTS)


@pytest.mark.parametrize("stop_after", [1, 6])
def test_a_state_from_before_order_versions_resumes_exactly(dataset_dir: str, stop_after: int) -> None:
    ds = old_run(dataset_dir)
    ds.set_epoch(2)
    full = batches_of(ds)
    first = old_run(dataset_dir)
    first.set_epoch(2)
    iterator = iter(first)
    head = [indices(next(iterator)).tolist() for _ in range(stop_after)]
    state = first.state_dict()
    del iterator
    assert state["order_version"] == 1
    del state["order_version"]  # as saved before versions existed

    resumed = make(dataset_dir)  # today's defaults: they give way to the state's settings
    assert (resumed.order_version, resumed.shuffle_window) != (1, 8)
    resumed.load_state_dict(state)
    assert head + batches_of(resumed) == full, "an old state must finish its epoch in the old order"
    assert (resumed.order_version, resumed.shuffle_window, resumed.shuffle_block) == (1, 8, 16)
    later = old_run(dataset_dir)
    later.set_epoch(3)
    assert batches_of(resumed) == batches_of(later), "the run goes on with the order it began with"


def test_explicit_order_settings_must_match_the_state(dataset_dir: str) -> None:
    state = old_run(dataset_dir).state_dict()
    del state["order_version"]
    with pytest.raises(ValueError, match="order_version=1"):
        make(dataset_dir, order_version=2).load_state_dict(state)
    with pytest.raises(ValueError, match="shuffle_window=8"):
        make(dataset_dir, shuffle_window=256).load_state_dict(state)
    new = make(dataset_dir).state_dict()
    assert new["order_version"] == 2
    with pytest.raises(ValueError, match="order_version=2"):
        make(dataset_dir, order_version=1).load_state_dict(new)


# --- the hand-out rule: EpochCursor.handed_out, on a cursor alone ------------------------------------

SAMPLES, BATCH, WORLD = 60, 6, 2  # 5 batches a rank, 12 samples a round of both ranks


@pytest.fixture
def cursor() -> EpochCursor:
    settings = dict.fromkeys(ORDER_SETTINGS, 0) | {"batch_size": BATCH, "drop_last": False}
    return EpochCursor(BATCH, rank=1, world_size=WORLD, drop_last=False, settings=settings)


def pulled_from(batches, pulled: list) -> Iterator:
    for batch in batches:
        pulled.append(batch)
        yield batch


def one_ahead(batches) -> Iterator:
    """Fetches batch k + 1 before yielding batch k, as DeviceLoader's CUDA copy does."""
    batches = iter(batches)
    upcoming = next(batches, None)
    while upcoming is not None:
        current, upcoming = upcoming, next(batches, None)
        yield current


@pytest.mark.parametrize("stop_after", [0, 1, 3])
def test_a_batch_counts_when_handed_out_and_a_closed_iterator_keeps_the_count(
        cursor: EpochCursor, stop_after: int) -> None:
    epoch_pass = cursor.begin(SAMPLES, generation=1)
    handed = cursor.handed_out(epoch_pass, epoch_pass.batches)
    received = [next(handed) for _ in range(stop_after)]
    assert received == list(epoch_pass.batches[:stop_after])
    state = cursor.state_dict(SAMPLES, 1)
    assert (state["batches_seen"], state["position"]) == (stop_after, stop_after * BATCH * WORLD)
    handed.close()
    assert cursor.state_dict(SAMPLES, 1)["batches_seen"] == stop_after
    assert next(handed, None) is None


@pytest.mark.parametrize("stop_after", [1, 3])
def test_batches_fetched_ahead_inside_count_only_once_they_come_out(cursor: EpochCursor,
                                                                     stop_after: int) -> None:
    epoch_pass = cursor.begin(SAMPLES, generation=1)
    pulled: list = []
    handed = cursor.handed_out(epoch_pass, one_ahead(pulled_from(epoch_pass.batches, pulled)))
    for _ in range(stop_after):
        next(handed)
    assert len(pulled) == stop_after + 1
    assert cursor.batches_seen == stop_after


def test_an_exhausted_pass_leaves_its_epoch_finished(cursor: EpochCursor) -> None:
    epoch_pass = cursor.begin(SAMPLES, generation=1)
    assert list(cursor.handed_out(epoch_pass, one_ahead(epoch_pass.batches))) == list(epoch_pass.batches)
    state = cursor.state_dict(SAMPLES, 1)
    assert (state["epoch"], state["batches_seen"], state["position"]) == (0, 5, SAMPLES)
    assert cursor.next_pass() == (1, 0, None)


def test_an_older_pass_counts_nothing_once_another_began(cursor: EpochCursor) -> None:
    first = cursor.begin(SAMPLES, generation=1)
    old = cursor.handed_out(first, first.batches)
    next(old), next(old)
    second = cursor.begin(SAMPLES, generation=1)
    new = cursor.handed_out(second, second.batches)
    next(new)
    next(old)
    assert (cursor.epoch, cursor.batches_seen) == (1, 1)


# --- either layout, and a bucketed dataset's bucket positions ------------------------------------------------

def test_a_state_taken_through_workers_resumes_exactly(layout_dataset: LayoutDataset) -> None:
    path = layout_dataset.path
    whole = [b["__key__"] for b in ShardDataset(path, 4, shuffle=True, seed=9)]
    ds = ShardDataset(path, 4, shuffle=True, seed=9)
    loader = ShardLoader(ds, num_workers=2)
    head = []
    for batch in loader:
        head.append(batch["__key__"])
        if len(head) == 5:
            state = loader.state_dict()
            break
    resumed = ShardDataset(path, 4, shuffle=True, seed=9)
    resumed.load_state_dict(state)
    rest = [b["__key__"] for b in ShardLoader(resumed, num_workers=2)]
    assert head + rest == whole


@pytest.fixture(scope="module")
def bucketed(tmp_path_factory: pytest.TempPathFactory) -> str:
    directory = str(tmp_path_factory.mktemp("buckets-resume"))
    return make_bucketed_dataset(directory, buckets=READ_BUCKETS, samples=READ_BUCKET_SIZES, samples_per_shard=6)


def bucket_ranks(directory: str, world_size: int, **kwargs) -> list[ShardDataset]:
    return [ShardDataset(directory, 4, shuffle=True, seed=7, rank=r, world_size=world_size, **kwargs)
            for r in range(world_size)]


@pytest.mark.parametrize("world_size", [1, 3])
def test_a_bucketed_resume_at_the_same_world_size_gives_the_same_batches(bucketed: str, world_size: int) -> None:
    whole = lockstep(bucket_ranks(bucketed, world_size))
    first = bucket_ranks(bucketed, world_size)
    lockstep(first, 5)
    states = [ds.state_dict() for ds in first]
    assert states[0]["bucket_positions"] == states[-1]["bucket_positions"]
    assert sum(states[0]["bucket_positions"]) == states[0]["position"]
    resumed = bucket_ranks(bucketed, world_size)
    for ds, state in zip(resumed, states):
        ds.load_state_dict(state)
    rest = lockstep(resumed)
    for rank in range(world_size):
        assert rest[rank] == whole[rank][5:]
    assert all(ds.batches_seen == len(ds) for ds in resumed)


def test_a_bucketed_state_before_the_first_batch_resumes_at_the_start(bucketed: str) -> None:
    fresh = bucket_ranks(bucketed, 2)
    states = [ds.state_dict() for ds in fresh]
    assert states[0]["bucket_positions"] == [0, 0, 0]
    whole = lockstep(bucket_ranks(bucketed, 2))
    resumed = bucket_ranks(bucketed, 2)
    for ds, state in zip(resumed, states):
        ds.load_state_dict(state)
    assert lockstep(resumed) == whole
