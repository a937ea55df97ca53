"""Elastic resume: a state saved at one world size (and number of workers) resumes at another, and the
new ranks together finish the epoch with every not-yet-seen sample exactly once, equal batch counts."""

from __future__ import annotations

import numpy as np
import pytest
from dataset_fixtures import assert_exactly_once, indices, make_dataset

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
