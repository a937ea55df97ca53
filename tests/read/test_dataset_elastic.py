"""Elastic resume: a state saved at one world size (and number of workers) resumes at another, and the
new ranks together finish the epoch with every not-yet-seen sample exactly once, equal batch counts; a
bucketed dataset's ranks stay in step bucket by bucket across the change."""

from __future__ import annotations

import numpy as np
import pytest
from bucket_fixtures import make_bucketed_dataset
from dataset_fixtures import assert_exactly_once, indices, make_dataset
from layout_fixtures import READ_BUCKET_SIZES, READ_BUCKETS, LayoutDataset, counted, every_key, lockstep

from shardio import ShardDataset, ShardLoader

SAMPLES, BATCH = 117, 5


@pytest.fixture(scope="module")
def dataset_dir(tmp_path_factory: pytest.TempPathFactory, encoding: str) -> str:
    directory = str(tmp_path_factory.mktemp("elastic"))
    make_dataset(directory, encoding=encoding)
    return directory


def rank(dataset_dir: str, r: int, world_size: int) -> ShardDataset:
    return ShardDataset(dataset_dir, BATCH, shuffle=True, seed=11, rank=r, world_size=world_size)


def run_and_stop(dataset_dir: str, world_size: int, workers: int, stop_after: int):
    """Every rank takes ``stop_after`` batches of epoch 1 (DDP lockstep); returns what they saw and the
    states each rank would save."""
    seen, states = [], []
    for r in range(world_size):
        ds = rank(dataset_dir, r, world_size)
        ds.set_epoch(1)
        source = iter(ShardLoader(ds, num_workers=workers) if workers else ds)
        seen += [indices(next(source)) for _ in range(stop_after)]
        states.append(ds.state_dict())
        del source
    return seen, states


def finish(dataset_dir: str, world_size: int, workers: int, state: dict) -> list[list[np.ndarray]]:
    ranks = []
    for r in range(world_size):
        ds = rank(dataset_dir, r, world_size)
        ds.load_state_dict(state)
        ranks.append([indices(b) for b in (ShardLoader(ds, num_workers=workers) if workers else ds)])
    return ranks


@pytest.mark.parametrize("before,after,workers_before,workers_after,stop_after", [
    (4, 3, 0, 0, 3),   # 60 seen; 57 left: 3 full rounds of 15 and 12 split 4/4/4
    (2, 5, 2, 1, 3),   # 30 seen; 87 left: 3 full rounds of 25 and 12 split 3/3/2/2/2
    (2, 5, 0, 2, 5),   # 50 seen; 67 left
    (3, 1, 1, 0, 2),   # 30 seen; everything left on one rank
])
def test_resume_at_another_world_size_sees_every_sample_once(
    dataset_dir: str, before: int, after: int, workers_before: int, workers_after: int, stop_after: int
) -> None:
    head, states = run_and_stop(dataset_dir, before, workers_before, stop_after)
    assert all(s["position"] == stop_after * BATCH * before for s in states), "a global position"
    assert len({tuple(sorted(s.items())) for s in ({**s, "rank": 0} for s in states)}) == 1, \
        "any rank's state stands for all"
    tail = finish(dataset_dir, after, workers_after, states[0])
    assert len({len(batches) for batches in tail}) == 1, "ranks yield different batch counts"
    assert_exactly_once(np.concatenate(head + [b for batches in tail for b in batches]), SAMPLES)

    # The order is the epoch's: what the old ranks saw is its head, the new ranks deal out the rest.
    order = rank(dataset_dir, 0, 1).sample_order(1)
    position = stop_after * BATCH * before
    assert set(np.concatenate(head)) == set(order[:position])
    full_rounds = (SAMPLES - position) // (BATCH * after)
    for k in range(full_rounds):
        for r in range(after):
            g = position + (k * after + r) * BATCH
            assert (tail[r][k] == order[g : g + BATCH]).all(), f"new rank {r} batch {k} out of order"


def test_resume_twice_across_world_sizes(dataset_dir: str) -> None:
    """4 ranks stop, 3 resume and stop again, 2 finish: the second state is global too."""
    head, states = run_and_stop(dataset_dir, 4, 0, 2)  # 40 seen
    middle, second = [], []
    for r in range(3):
        ds = rank(dataset_dir, r, 3)
        ds.load_state_dict(states[0])
        batches = iter(ds)
        middle += [indices(next(batches)) for _ in range(2)]  # 30 more
        second.append(ds.state_dict())
    assert {s["position"] for s in second} == {70} and {s["epoch"] for s in second} == {1}
    tail = finish(dataset_dir, 2, 0, second[0])
    assert_exactly_once(np.concatenate(head + middle + [b for batches in tail for b in batches]), SAMPLES)


def test_a_finished_epoch_resumes_at_the_next(dataset_dir: str) -> None:
    """A state taken at the end of an epoch (Lightning's end-of-epoch checkpoint): the next iteration is
    the next epoch; an epoch loop that pins the finished epoch again gets nothing more of it."""
    ds = rank(dataset_dir, 0, 2)
    ds.set_epoch(1)
    for _ in ds:
        pass
    state = ds.state_dict()
    assert state["position"] == SAMPLES and state["epoch"] == 1
    other = rank(dataset_dir, 0, 3)
    other.load_state_dict(state)
    got = np.concatenate([indices(b) for b in other])
    positions = np.concatenate([np.arange(r.start, r.stop) for r in other.cursor.current.batches])
    assert other.epoch == 2 and len(positions) > 30 and (got == other.sample_order(2)[positions]).all()
    pinned = rank(dataset_dir, 0, 3)
    pinned.load_state_dict(state)
    pinned.set_epoch(1)
    assert list(pinned) == [] and pinned.epoch == 1


def test_a_version_1_state_resumes_at_another_world_size(dataset_dir: str) -> None:
    """A state saved before order version 2 (windows of 8, blocks of 16, no order_version) on 4 ranks
    finishes on 3 ranks built with today's defaults: every sample once, in the old epoch's order."""
    old = {"shuffle_window": 8, "shuffle_block": 16, "order_version": 1}
    head, states = [], []
    for r in range(4):
        ds = ShardDataset(dataset_dir, BATCH, shuffle=True, seed=11, rank=r, world_size=4, **old)
        ds.set_epoch(1)
        source = iter(ds)
        head += [indices(next(source)) for _ in range(3)]  # 60 seen; 57 left: 3 rounds of 15, 12 split 4/4/4
        states.append({k: v for k, v in ds.state_dict().items() if k != "order_version"})
        del source
    tail = finish(dataset_dir, 3, 0, states[0])
    assert_exactly_once(np.concatenate(head + [b for batches in tail for b in batches]), SAMPLES)
    order = ShardDataset(dataset_dir, BATCH, shuffle=True, seed=11, **old).sample_order(1)
    assert (tail[0][0] == order[60:65]).all() and (tail[2][1] == order[85:90]).all()


# --- either layout: lockstep ranks, a bucket at a time ---------------------------------------------------------

def lockstep_ranks(directory: str, world_size: int, **kwargs) -> list[ShardDataset]:
    return [ShardDataset(directory, 4, shuffle=True, seed=7, rank=r, world_size=world_size, **kwargs)
            for r in range(world_size)]


@pytest.mark.parametrize("old,new", [(3, 2), (2, 5), (1, 4)])
def test_resume_at_another_world_size_sees_every_remaining_sample_once(layout_dataset: LayoutDataset, old: int,
                                                                       new: int) -> None:
    data = layout_dataset
    first = lockstep_ranks(data.path, old)
    head = lockstep(first, 4)
    state = first[0].state_dict()
    resumed = lockstep_ranks(data.path, new)
    for ds in resumed:
        ds.load_state_dict(state)
    tail = lockstep(resumed)
    seen, later = counted(head), counted(tail)
    assert not set(seen) & set(later)
    assert set(seen) | set(later) == set(every_key(ShardDataset(data.path, 4)))
    # repeats only where a rank had nothing left of a bucket's short round: at most W - 1 a bucket
    assert sum(seen.values()) - len(seen) <= (old - 1) * len(data.shapes)
    assert sum(later.values()) - len(later) <= (new - 1) * len(data.shapes)
    # the next epoch starts fresh
    assert all(len(list(ds)) == len(ds) for ds in resumed)


@pytest.fixture(scope="module")
def bucketed(tmp_path_factory: pytest.TempPathFactory) -> str:
    directory = str(tmp_path_factory.mktemp("buckets-elastic"))
    return make_bucketed_dataset(directory, buckets=READ_BUCKETS, samples=READ_BUCKET_SIZES, samples_per_shard=6)


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("last", [5, 2, 3])
def test_a_bucketed_state_saved_after_scaling_up_resumes_at_any_world_size(bucketed: str, drop_last: bool,
                                                                           last: int) -> None:
    """2 ranks for 9 steps, then 5 ranks for one step, a state, then resumed at ``last`` ranks to the end:
    the chain's batches see every sample once (repeats only where a rank had nothing left of a short
    round)."""
    every = every_key(ShardDataset(bucketed, 4))
    first = lockstep_ranks(bucketed, 2, drop_last=drop_last)
    head = lockstep(first, 3 if drop_last else 9)  # drop_last: 5 ranks still have a full round left
    scaled = lockstep_ranks(bucketed, 5, drop_last=drop_last)
    for ds in scaled:
        ds.load_state_dict(first[0].state_dict())
    middle = lockstep(scaled, 1)
    state = scaled[0].state_dict()
    assert state["epoch"] == 0 and 0 <= state["batches_seen"] <= len(scaled[0])
    resumed = lockstep_ranks(bucketed, last, drop_last=drop_last)
    for ds in resumed:
        ds.load_state_dict(state)
    tail = lockstep(resumed)
    assert all(0 < ds.batches_seen <= len(ds) for ds in resumed)
    parts = [counted(part) for part in (head, middle, tail)]
    for a, b in ((0, 1), (0, 2), (1, 2)):
        assert not set(parts[a]) & set(parts[b])
    seen = set().union(*parts)
    if drop_last:  # each bucket drops less than a round of the layout its rest was cut at
        assert seen <= set(every)
        assert len(every) - len(seen) < len(READ_BUCKETS) * 4 * 5
    else:
        assert seen == set(every)
    for part, world in zip(parts, (2, 5, last)):
        assert sum(part.values()) - len(part) <= (world - 1) * len(READ_BUCKETS)


def test_a_bucketed_state_numbered_at_an_earlier_world_size_still_resumes(bucketed: str) -> None:
    """A state whose ``batches_seen`` counts the batches of a layout before a resume (past this world
    size's epoch) resumes from its bucket positions, every remaining sample once."""
    first = lockstep_ranks(bucketed, 2)
    head = lockstep(first, 9)
    scaled = lockstep_ranks(bucketed, 5)
    for ds in scaled:
        ds.load_state_dict(first[0].state_dict())
    middle = lockstep(scaled, 1)
    state = {**scaled[0].state_dict(), "batches_seen": 10}  # 9 steps at 2 ranks, then one at 5
    assert state["batches_seen"] > len(scaled[0])
    resumed = lockstep_ranks(bucketed, 5)
    for ds in resumed:
        ds.load_state_dict(state)
    tail = lockstep(resumed)
    seen = [counted(part) for part in (head, middle, tail)]
    assert set().union(*seen) == set(every_key(ShardDataset(bucketed, 4)))
    assert not set(seen[2]) & (set(seen[0]) | set(seen[1]))
    with pytest.raises(ValueError, match="batches_seen=-1"):
        lockstep_ranks(bucketed, 5)[0].load_state_dict({**state, "batches_seen": -1})
