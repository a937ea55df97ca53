"""Resuming a bucketed dataset: exactly at the same world size, every remaining sample once at another,
on the state's generation after a committed drop."""

from __future__ import annotations

from collections import Counter

import pytest
from bucket_fixtures import make_bucketed_dataset
from dataset_fixtures import retire_input

from shardio import ShardDataset, ShardLoader

BUCKETS = [(8, 12), (12, 8), (10, 10)]
BATCH = 4


@pytest.fixture(scope="module")
def bucketed(tmp_path_factory: pytest.TempPathFactory) -> str:
    directory = str(tmp_path_factory.mktemp("buckets-resume"))
    return make_bucketed_dataset(directory, buckets=BUCKETS, samples=[23, 41, 9], samples_per_shard=6)


def ranks(directory: str, world_size: int, **kwargs) -> list[ShardDataset]:
    return [ShardDataset(directory, BATCH, shuffle=True, seed=7, rank=r, world_size=world_size, **kwargs)
            for r in range(world_size)]


def every_key(directory: str) -> Counter:
    ds = ShardDataset(directory, BATCH)
    return Counter(ds.sample(i)["__key__"] for i in range(ds.num_samples))


def lockstep(datasets: list[ShardDataset], steps: int | None = None) -> list[list[list[str]]]:
    """Each rank's batches' keys, the ranks stepping together (``steps``: that many, else to the end)."""
    iterators = [iter(ds) for ds in datasets]
    out: list[list[list[str]]] = [[] for _ in datasets]
    step = 0
    while steps is None or step < steps:
        try:
            batches = [next(it) for it in iterators]
        except StopIteration:
            break
        assert len({b["bucket"] for b in batches}) == 1
        for rank, batch in enumerate(batches):
            out[rank].append(batch["__key__"])
        step += 1
    return out


def counted(steps: list[list[list[str]]]) -> Counter:
    """How often each key comes in ``lockstep``'s batches."""
    return Counter(k for batches in steps for batch in batches for k in batch)


@pytest.mark.parametrize("world_size", [1, 3])
def test_resume_at_the_same_world_size_gives_the_same_batches(bucketed: str, world_size: int) -> None:
    whole = lockstep(ranks(bucketed, world_size))
    first = ranks(bucketed, world_size)
    lockstep(first, 5)
    states = [ds.state_dict() for ds in first]
    assert states[0]["bucket_positions"] == states[-1]["bucket_positions"]
    assert sum(states[0]["bucket_positions"]) == states[0]["position"]
    resumed = ranks(bucketed, world_size)
    for ds, state in zip(resumed, states):
        ds.load_state_dict(state)
    rest = lockstep(resumed)
    for rank in range(world_size):
        assert rest[rank] == whole[rank][5:]
    assert all(ds.batches_seen == len(ds) for ds in resumed)


@pytest.mark.parametrize("old,new", [(3, 2), (2, 5), (1, 4)])
def test_resume_at_another_world_size_sees_every_remaining_sample_once(bucketed: str, old: int, new: int) -> None:
    first = ranks(bucketed, old)
    head = lockstep(first, 4)
    state = first[0].state_dict()
    resumed = ranks(bucketed, new)
    for ds in resumed:
        ds.load_state_dict(state)
    tail = lockstep(resumed)
    seen = Counter(k for batches in head for batch in batches for k in batch)
    later = Counter(k for batches in tail for batch in batches for k in batch)
    assert not set(seen) & set(later)
    assert set(seen) | set(later) == set(every_key(bucketed))
    # repeats only where a rank had nothing left of a bucket's short round: at most W - 1 a bucket
    assert sum(seen.values()) - len(seen) <= (old - 1) * len(BUCKETS)
    assert sum(later.values()) - len(later) <= (new - 1) * len(BUCKETS)
    # the next epoch starts fresh
    assert all(len(list(ds)) == len(ds) for ds in resumed)


def test_a_state_resumes_its_generation_after_a_committed_drop(tmp_path) -> None:
    directory = make_bucketed_dataset(str(tmp_path), buckets=BUCKETS, samples=[23, 41, 9], samples_per_shard=6,
                                      inputs=2)
    before = every_key(directory)
    ds = ShardDataset(directory, BATCH, shuffle=True, seed=1)
    iterator = iter(ds)
    head = [next(iterator)["__key__"] for _ in range(6)]
    state = ds.state_dict()
    newer = retire_input(directory, "input-0.tar")  # the fixture's first input
    assert newer > state["generation"]
    resumed = ShardDataset(directory, BATCH, shuffle=True, seed=1)
    resumed.load_state_dict(state)
    tail = [b["__key__"] for b in ShardLoader(resumed, num_workers=2)]
    seen = Counter(k for batch in head + tail for k in batch)
    assert set(seen) == set(before) and set(seen.values()) == {1}
    assert resumed.snapshot.generation == state["generation"]
    after = list(resumed)  # the next epoch moves to the newest generation
    assert resumed.snapshot.generation == newer
    assert sum(len(b["__key__"]) for b in after) == resumed.num_samples < len(before)


def test_a_state_of_another_kind_is_refused(bucketed: str, tmp_path) -> None:
    from dataset_fixtures import make_dataset
    make_dataset(str(tmp_path))
    single = ShardDataset(str(tmp_path), BATCH)
    bucket = ShardDataset(bucketed, BATCH)
    state = bucket.state_dict()
    state.pop("dataset", None)
    state["samples"] = single.num_samples
    state["generation"] = single.snapshot.generation
    with pytest.raises(ValueError, match="bucketed"):
        single.load_state_dict(state)


def test_a_state_before_the_first_batch_resumes_at_the_start(bucketed: str) -> None:
    fresh = ranks(bucketed, 2)
    states = [ds.state_dict() for ds in fresh]
    assert states[0]["bucket_positions"] == [0, 0, 0]
    whole = lockstep(ranks(bucketed, 2))
    resumed = ranks(bucketed, 2)
    for ds, state in zip(resumed, states):
        ds.load_state_dict(state)
    assert lockstep(resumed) == whole


@pytest.mark.parametrize("epoch, stop", [(0, 7), (2, 3)])
def test_a_mix_of_bucketed_datasets_resumes_at_exactly_the_next_batch(bucketed: str, tmp_path, epoch: int,
                                                                      stop: int) -> None:
    from shardio.read.mixing import MixedDataset
    other = make_bucketed_dataset(str(tmp_path / "other"), buckets=BUCKETS, samples=[5, 7, 11], samples_per_shard=4)

    def mixed() -> MixedDataset:
        return MixedDataset([ShardDataset(bucketed, BATCH, shuffle=True), ShardDataset(other, BATCH, shuffle=True)],
                            [1, 3], seed=2)

    def keys(source) -> list[list[str]]:
        return [b["__key__"] for b in source]

    reference = mixed()
    for e in range(epoch):  # epochs before: each dataset is placed in its own epochs by seek
        reference.set_epoch(e)
        keys(reference)
    reference.set_epoch(epoch)
    iterator = iter(reference)
    head = [next(iterator)["__key__"] for _ in range(stop)]
    state = reference.state_dict()
    rest = keys(iterator)
    resumed = mixed()
    resumed.load_state_dict(state)
    resumed.set_epoch(epoch)
    assert keys(resumed) == rest and len(head) + len(rest) == len(reference)
    placed = mixed()  # a fresh mix asked for this epoch places each dataset by seek, as the reference ran
    placed.set_epoch(epoch)
    assert keys(placed) == head + rest


def test_a_state_taken_through_workers_resumes_exactly(bucketed: str) -> None:
    whole = [b["__key__"] for b in ShardDataset(bucketed, BATCH, shuffle=True, seed=9)]
    ds = ShardDataset(bucketed, BATCH, shuffle=True, seed=9)
    loader = ShardLoader(ds, num_workers=2)
    head = []
    for batch in loader:
        head.append(batch["__key__"])
        if len(head) == 5:
            state = loader.state_dict()
            break
    resumed = ShardDataset(bucketed, BATCH, shuffle=True, seed=9)
    resumed.load_state_dict(state)
    rest = [b["__key__"] for b in ShardLoader(resumed, num_workers=2)]
    assert head + rest == whole


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("last", [5, 2, 3])
def test_a_state_saved_after_scaling_up_resumes_at_any_world_size(bucketed: str, drop_last: bool,
                                                                  last: int) -> None:
    """2 ranks for 9 steps, then 5 ranks for one step, a state, then resumed at ``last`` ranks to the end:
    the chain's batches see every sample once (repeats only where a rank had nothing left of a short
    round)."""
    first = ranks(bucketed, 2, drop_last=drop_last)
    head = lockstep(first, 3 if drop_last else 9)  # drop_last: 5 ranks still have a full round left
    scaled = ranks(bucketed, 5, drop_last=drop_last)
    for ds in scaled:
        ds.load_state_dict(first[0].state_dict())
    middle = lockstep(scaled, 1)
    state = scaled[0].state_dict()
    assert state["epoch"] == 0 and 0 <= state["batches_seen"] <= len(scaled[0])
    resumed = ranks(bucketed, last, drop_last=drop_last)
    for ds in resumed:
        ds.load_state_dict(state)
    tail = lockstep(resumed)
    assert all(0 < ds.batches_seen <= len(ds) for ds in resumed)
    parts = [counted(part) for part in (head, middle, tail)]
    for a, b in ((0, 1), (0, 2), (1, 2)):
        assert not set(parts[a]) & set(parts[b])
    seen = set().union(*parts)
    if drop_last:  # each bucket drops less than a round of the layout its rest was cut at
        assert seen <= set(every_key(bucketed))
        assert len(every_key(bucketed)) - len(seen) < len(BUCKETS) * BATCH * 5
    else:
        assert seen == set(every_key(bucketed))
    for part, world in zip(parts, (2, 5, last)):
        assert sum(part.values()) - len(part) <= (world - 1) * len(BUCKETS)


def test_a_state_numbered_at_an_earlier_world_size_still_resumes(bucketed: str) -> None:
    """A state whose ``batches_seen`` counts the batches of a layout before a resume (past this world
    size's epoch) resumes from its bucket positions, every remaining sample once."""
    first = ranks(bucketed, 2)
    head = lockstep(first, 9)
    scaled = ranks(bucketed, 5)
    for ds in scaled:
        ds.load_state_dict(first[0].state_dict())
    middle = lockstep(scaled, 1)
    state = {**scaled[0].state_dict(), "batches_seen": 10}  # 9 steps at 2 ranks, then one at 5
    assert state["batches_seen"] > len(scaled[0])
    resumed = ranks(bucketed, 5)
    for ds in resumed:
        ds.load_state_dict(state)
    tail = lockstep(resumed)
    seen = [counted(part) for part in (head, middle, tail)]
    assert set().union(*seen) == set(every_key(bucketed)) and not set(seen[2]) & (set(seen[0]) | set(seen[1]))
    with pytest.raises(ValueError, match="batches_seen=-1"):
        ranks(bucketed, 5)[0].load_state_dict({**state, "batches_seen": -1})
