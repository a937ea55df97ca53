"""``shardio.read.subset.SubsetDataset``: subsets by key list, by input and by fraction, read exactly.

The dataset is ``tests/training_helpers.py``'s: 117 self-identifying samples from inputs of 40, 45, 32
in shards of 8 (every input ends in a partial shard).
"""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest

from shardio.errors import ShardError
from shardio.train.loader import ShardLoader
from shardio.read.subset import SubsetDataset, fraction_member
from tests.dataset_fixtures import assert_exactly_once, retire_input
from tests.layout_fixtures import LayoutDataset, batch_bucket, every_key
from tests.training_helpers import ids, make_mixed_dataset

INPUTS = (40, 45, 32)
SAMPLES = sum(INPUTS)


@pytest.fixture(scope="module")
def path(tmp_path_factory, encoding: str) -> str:
    directory = str(tmp_path_factory.mktemp("subset") / "ds")
    make_mixed_dataset(directory, INPUTS, (True, False, True), encoding=encoding)
    return directory


def read_epoch(ds) -> np.ndarray:
    return np.concatenate([ids(batch) for batch in ds])


def assert_reads_exactly(ds: SubsetDataset, expected: set[int], epochs: int = 2) -> None:
    orders = []
    for epoch in range(epochs):
        ds.set_epoch(epoch)
        seen = read_epoch(ds)
        assert set(seen) <= expected, f"samples outside the subset: {sorted(set(seen) - expected)[:10]}"
        assert_exactly_once(np.searchsorted(sorted(expected), seen), len(expected))
        orders.append(seen.tolist())
    if epochs > 1 and ds.shuffle:
        assert orders[0] != orders[1], "each epoch has its own order"


@pytest.mark.parametrize("shuffle", [False, True])
def test_a_key_list_reads_exactly_those_samples(path, shuffle):
    rng = np.random.default_rng(5)
    chosen = set(rng.choice(SAMPLES, 37, replace=False).tolist())
    ds = SubsetDataset(path, 6, keys=[f"s{i:06d}" for i in chosen], shuffle=shuffle, seed=1)
    assert len(ds.snapshot) == 37 and len(ds) == math.ceil(37 / 6)
    assert_reads_exactly(ds, chosen)
    if not shuffle:
        assert read_epoch(ds).tolist() == sorted(chosen), "unshuffled: stored order"


def test_a_selection_keeps_each_samples_bucket(layout_dataset: LayoutDataset):
    """A key selection of a bucketed dataset reads each chosen sample once, in a batch of its own bucket."""
    from shardio.read.dataset import ShardDataset
    from shardio.read.selection import SampleSelection

    data = layout_dataset
    whole = ShardDataset(data.path, 4)
    keys = sorted(every_key(whole))[::3]
    ds = ShardDataset(data.path, 4, shuffle=True, selection=SampleSelection(keys=tuple(keys)))
    seen = Counter()
    for batch in ds:
        data.check(batch)
        for key in batch["__key__"]:
            assert tuple(whole.sample(whole.find(key))["image"].shape[:2]) == ds.buckets[batch_bucket(batch)]
        seen.update(batch["__key__"])
    assert seen == Counter(keys)


def test_an_input_subset_reads_exactly_that_input(path):
    ds = SubsetDataset(path, 8, inputs=["input-1.tar"], shuffle=True)
    assert_reads_exactly(ds, set(range(40, 85)))
    both = SubsetDataset(path, 8, inputs=["input-0.tar", "input-2.tar"], shuffle=True)
    assert_reads_exactly(both, set(range(40)) | set(range(85, SAMPLES)))


def test_caption_only_input_subset_has_no_cls_and_labelled_one_has_it(path):
    assert all("cls" not in b for b in SubsetDataset(path, 8, inputs=["input-1.tar"]))
    assert all("cls" in b for b in SubsetDataset(path, 8, inputs=["input-0.tar"]))


def test_a_fraction_is_decided_per_key_stable_across_opens_and_appends(path, tmp_path):
    fraction = 0.3
    ds = SubsetDataset(path, 5, fraction=fraction, fraction_seed=2, shuffle=True)
    members = {i for i in range(SAMPLES) if fraction_member(f"s{i:06d}", fraction, 2)}
    assert_reads_exactly(ds, members)
    # the count is binomial(N, f): within 4.5 sd (a correct hash fails this for ~1 seed in 150,000)
    assert abs(len(members) - fraction * SAMPLES) < 4.5 * math.sqrt(SAMPLES * fraction * (1 - fraction))
    assert ds.snapshot.selected.tolist() == sorted(members)
    again = SubsetDataset(path, 7, fraction=fraction, fraction_seed=2, rank=1, world_size=2)
    assert again.snapshot.selected.tolist() == sorted(members), "same on every rank and every open"
    other_seed = SubsetDataset(path, 5, fraction=fraction, fraction_seed=3)
    assert other_seed.snapshot.selected.tolist() != sorted(members)
    grown = str(tmp_path / "grown")
    make_mixed_dataset(grown, (*INPUTS, 50), (True, False, True, True))  # a nightly run added an input
    grown_subset = SubsetDataset(grown, 5, fraction=fraction, fraction_seed=2)
    grown_members = set(grown_subset.snapshot.selected.tolist())
    assert grown_members & set(range(SAMPLES)) == members, "appending keeps the old members, adds no old one"


def test_criteria_intersect(path):
    ds = SubsetDataset(path, 4, inputs=["input-2.tar"], keys=[f"s{i:06d}" for i in range(80, 100)])
    assert_reads_exactly(ds, set(range(85, 100)), epochs=1)


def test_ranks_split_a_subset_and_resume_within_it(path):
    chosen = set(range(3, 110, 2))  # 54 samples: every other one, so every segment is one sample long
    keys = [f"s{i:06d}" for i in chosen]
    ranks = [SubsetDataset(path, 9, keys=keys, shuffle=True, rank=r, world_size=3) for r in range(3)]
    assert len({len(ds) for ds in ranks}) == 1
    assert_exactly_once(np.searchsorted(sorted(chosen), np.concatenate([read_epoch(d) for d in ranks])),
                        len(chosen))
    loader = ShardLoader(ranks[0])
    iterator = iter(loader)
    first = ids(next(iterator))
    rest = [ids(b).tolist() for b in iterator]
    state = loader.state_dict(1)
    resumed = ShardLoader(SubsetDataset(path, 9, keys=keys, shuffle=True, rank=0, world_size=3))
    resumed.load_state_dict(state)
    assert [ids(b).tolist() for b in resumed] == rest
    assert len(first) == 9


def test_workers_read_the_same_subset(path):
    ds = SubsetDataset(path, 4, inputs=["input-1.tar"], shuffle=True)
    alone = [ids(b).tolist() for b in ds]
    ds.set_epoch(0)  # each new iteration is the next epoch: compare the same one
    with_workers = [ids(b).tolist() for b in ShardLoader(ds, num_workers=2, multiprocessing_context="spawn")]
    assert with_workers == alone


def test_unknown_keys_or_inputs_and_empty_subsets_are_clear_errors(path):
    with pytest.raises(ShardError, match=r"1 of the 2 subset keys are not in the dataset.*nope"):
        SubsetDataset(path, 4, keys=["s000001", "nope"])
    with pytest.raises(ShardError, match=r"no input named \['x.tar'\].*input-0.tar"):
        SubsetDataset(path, 4, inputs=["x.tar"])
    with pytest.raises(ShardError, match="selects no sample"):
        SubsetDataset(path, 4, inputs=["input-0.tar"], keys=["s000050"])
    with pytest.raises(ValueError, match="fraction"):
        SubsetDataset(path, 4, fraction=1.5)
    with pytest.raises(ValueError, match="no full batch"):
        SubsetDataset(path, 8, keys=["s000001"], drop_last=True)



@pytest.mark.parametrize("prefetch", [0, 3])
def test_a_resumed_subset_finishes_its_epoch_on_the_pinned_generation_then_follows(tmp_path, prefetch):
    directory = str(tmp_path / "ds")
    make_mixed_dataset(directory, INPUTS, (True, False, True))
    fraction, seed = 0.5, 4
    members = {i for i in range(SAMPLES) if fraction_member(f"s{i:06d}", fraction, seed)}

    def subset() -> SubsetDataset:
        return SubsetDataset(directory, 5, fraction=fraction, fraction_seed=seed, shuffle=True,
                             prefetch=prefetch)

    ds = subset()
    batches = iter(ds)
    head = np.concatenate([ids(next(batches)) for _ in range(4)])
    state = ds.state_dict()
    full = read_epoch(subset())  # the uninterrupted epoch 0
    retire_input(directory, "input-2.tar")  # a newer generation without samples 85..116

    resumed = subset()
    assert resumed.snapshot.generation == state["generation"] + 1
    resumed.load_state_dict(state)
    rest = read_epoch(resumed)
    assert np.concatenate([head, rest]).tolist() == full.tolist(), "the epoch finished on its generation"
    assert set(resumed.snapshot.selected.tolist()) == members
    following = read_epoch(resumed)  # the next epoch: the newest generation, the same criteria
    remaining = {i for i in members if i < 85}
    assert set(following.tolist()) <= remaining
    assert_exactly_once(np.searchsorted(sorted(remaining), following), len(remaining))
