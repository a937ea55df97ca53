"""``shardio.read.mixing.MixedDataset``: weights, epoch length, resume and DDP equality; bucketed datasets mixed
one bucket a batch, resumed at exactly the next batch.

Two self-identifying datasets: A holds samples 0..116, B samples 1000..1049 (``first_index``), so the
pixels of every batch tell which dataset and which samples it came from.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from shardio.read.dataset import ShardDataset
from shardio.errors import DatasetIncompatibleError
from shardio.format.manifests import load_manifest
from shardio.read.mixing import MixedDataset
from shardio.read.subset import SubsetDataset
from shardio.write.shard_writer import write_manifest
from tests.bucket_fixtures import key_bucket, key_index, make_bucketed_dataset
from tests.dataset_fixtures import assert_exactly_once, make_dataset, pixel_indices
from tests.layout_fixtures import READ_BUCKET_SIZES, READ_BUCKETS, Layout, LayoutDataset
from tests.training_helpers import ids, make_mixed_dataset

B_FIRST = 1000
BATCH = 8


@pytest.fixture(scope="module")
def paths(tmp_path_factory, encoding: str) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("mixing")
    make_mixed_dataset(str(root / "a"), encoding=encoding)                    # 117 samples: 15 batches
    make_mixed_dataset(str(root / "b"), (20, 30), (False, True), first_index=B_FIRST,
                       encoding=encoding)                                     # 50: 7 batches
    return str(root / "a"), str(root / "b")


def mixed(paths, weights=(3.0, 1.0), rank=None, world_size=None, drop_last=False, **kwargs) -> MixedDataset:
    datasets = [ShardDataset(p, BATCH, shuffle=True, seed=s, rank=rank, world_size=world_size,
                             drop_last=drop_last) for s, p in enumerate(paths)]
    return MixedDataset(datasets, weights, seed=7, **kwargs)


def epoch_batches(ds: MixedDataset, epoch: int) -> list[np.ndarray]:
    ds.set_epoch(epoch)
    return [ids(batch) for batch in ds]


def binomial_sd(p: float, n: int) -> float:
    return math.sqrt(p * (1 - p) / n)


def test_each_source_is_drawn_with_its_weight_within_the_binomial_spread(paths):
    ds = mixed(paths, weights=(3.0, 1.0), batches_per_epoch=400)
    sources = []
    for epoch in range(3):
        ds.set_epoch(epoch)
        for batch in ds:
            found = ids(batch)
            source = int(found[0] >= B_FIRST)
            assert (found >= B_FIRST).all() == bool(source), "a batch comes whole from one dataset"
            assert batch["__source__"] == source
            sources.append(source)
    n, p = len(sources), 0.25
    share = float(np.mean(sources))
    # 4.5 binomial standard deviations: a correct mixer fails this about once in 150,000 seeds.
    assert abs(share - p) < 4.5 * binomial_sd(p, n), (share, p, n)


def test_each_dataset_is_read_in_its_own_epoch_orders_without_loss_or_repeat(paths):
    ds = mixed(paths, batches_per_epoch=60)
    seen: dict[int, list[int]] = {0: [], 1: []}
    for epoch in range(3):
        ds.set_epoch(epoch)
        for batch in ds:
            seen[batch["__source__"]].extend(ids(batch).tolist())
    for source, dataset in enumerate(ds.datasets):
        offset = B_FIRST if source else 0
        expected = np.concatenate([dataset.sample_order(e) + offset for e in range(40)])
        got = np.array(seen[source])
        assert len(got) > len(dataset.sample_order(0))  # several of its epochs went by
        assert (got == expected[: len(got)]).all()
        full = len(got) // dataset.samples * dataset.samples
        for start in range(0, full, dataset.samples):  # so every complete epoch of it has each sample once
            assert_exactly_once(got[start : start + dataset.samples] - offset, dataset.samples)


def test_epoch_length_is_fixed_and_an_epoch_does_not_depend_on_what_ran_before(paths):
    reference = mixed(paths)
    assert len(reference) == 15 + 7  # default: the datasets' batches together
    epochs = [epoch_batches(reference, e) for e in range(3)]
    assert all(len(batches) == len(reference) for batches in epochs)
    assert [b.tolist() for b in epochs[0]] != [b.tolist() for b in epochs[1]]
    fresh = mixed(paths)
    assert [b.tolist() for b in epoch_batches(fresh, 2)] == [b.tolist() for b in epochs[2]]


@pytest.mark.parametrize("epoch, stop", [(0, 0), (0, 5), (1, 9), (2, 21), (1, 22)])
def test_state_dict_resumes_at_exactly_the_next_batch(paths, epoch, stop):
    reference = mixed(paths)
    for e in range(epoch):
        epoch_batches(reference, e)
    reference.set_epoch(epoch)
    iterator = iter(reference)
    before = [ids(next(iterator)) for _ in range(stop)]
    state = reference.state_dict()
    after = [ids(b) for b in iterator]

    resumed = mixed(paths)  # a new process: fresh datasets, nothing iterated
    resumed.load_state_dict(state)
    # An epoch loop pins the state's epoch (a finished epoch's state would otherwise resume at the next
    # epoch, as ShardDataset's does; the last case then gets nothing more of epoch 1).
    resumed.set_epoch(epoch)
    again = [ids(b) for b in resumed]
    assert [b.tolist() for b in again] == [b.tolist() for b in after]
    assert len(before) + len(again) == len(reference)
    # and the epoch after continues as it would have
    assert [b.tolist() for b in epoch_batches(resumed, epoch + 1)] == \
        [b.tolist() for b in epoch_batches(reference, epoch + 1)]


def test_every_rank_yields_the_same_number_of_batches_from_the_same_sources(paths):
    # drop_last: without it, B's 50 = 2 x 24 + 2 samples give the third rank a repeated sample
    ranks = [mixed(paths, rank=r, world_size=3, drop_last=True) for r in range(3)]
    assert len({len(ds) for ds in ranks}) == 1
    sources, samples = [], []
    for ds in ranks:
        batches = list(ds)
        assert len(batches) == len(ds)
        sources.append([b["__source__"] for b in batches])
        # (dataset, that dataset's epoch, sample): a dataset may wrap into its next epoch mid-way
        samples.append({(b["__source__"], b["__epoch__"], int(i)) for b in batches for i in ids(b)})
    assert sources[0] == sources[1] == sources[2], "the ranks draw the same schedule: DDP stays in step"
    for a in range(3):
        for b in range(a + 1, 3):
            assert not samples[a] & samples[b], "within a dataset's epoch, ranks read disjoint samples"


def test_datasets_of_different_shapes_or_batch_sizes_are_refused(paths, tmp_path):
    make_mixed_dataset(str(tmp_path / "big"), (10,), (True,), side=16)
    a = ShardDataset(paths[0], BATCH)
    with pytest.raises(DatasetIncompatibleError, match=r"big.*\(16, 16, 3\).*same height and width"):
        MixedDataset([a, ShardDataset(str(tmp_path / "big"), BATCH)], [1, 1])
    with pytest.raises(ValueError, match="batch_size"):
        MixedDataset([a, ShardDataset(paths[1], BATCH * 2)], [1, 1])
    with pytest.raises(ValueError, match="weights"):
        MixedDataset([a, ShardDataset(paths[1], BATCH)], [1, -1])
    with pytest.raises(ValueError, match="twice"):
        MixedDataset([a, a], [1, 1])


def test_dataloader_workers_are_refused(paths):
    from torch.utils.data import DataLoader

    with pytest.raises(ValueError, match="num_workers=0"):
        list(DataLoader(mixed(paths), batch_size=None, num_workers=1))


def test_a_state_from_other_weights_is_refused(paths):
    state = mixed(paths, weights=(3, 1)).state_dict()
    with pytest.raises(ValueError, match="weights"):
        mixed(paths, weights=(1, 1)).load_state_dict(state)


def test_each_new_iteration_is_the_next_epoch_and_a_finished_state_resumes_at_the_next(paths):
    reference = mixed(paths)
    pinned = [[b.tolist() for b in epoch_batches(reference, e)] for e in range(3)]
    advancing = mixed(paths)
    assert [[ids(b).tolist() for b in advancing] for _ in range(3)] == pinned
    finished = advancing.state_dict()
    assert finished["epoch"] == 2 and finished["batches_seen"] == len(advancing)
    resumed = mixed(paths)
    resumed.load_state_dict(finished)
    assert [ids(b).tolist() for b in resumed] == [b.tolist() for b in epoch_batches(reference, 3)]


def test_the_state_holds_each_datasets_own_state(paths):
    ds = mixed(paths)
    iterator = iter(ds)
    batches = [next(iterator) for _ in range(9)]
    state = ds.state_dict()
    assert state["epoch"] == 0 and state["batches_seen"] == 9
    assert state["sources"] == [d.state_dict() for d in ds.datasets]
    for source, dataset_state in enumerate(state["sources"]):
        drawn = sum(b["__source__"] == source for b in batches)
        # the dataset's global position: samples consumed by all ranks (one rank here, full batches)
        assert dataset_state["position"] == drawn * BATCH


def test_a_state_taken_after_set_epoch_is_that_epochs_start(paths):
    reference = mixed(paths)
    expected = [b.tolist() for b in epoch_batches(reference, 2)]
    ds = mixed(paths)
    list(ds)  # epoch 0, finished
    ds.set_epoch(2)
    state = ds.state_dict()
    assert (state["epoch"], state["batches_seen"]) == (2, 0)
    resumed = mixed(paths)
    resumed.load_state_dict(state)
    assert [ids(b).tolist() for b in resumed] == expected


def plain_and_padded(tmp_path) -> tuple[str, str]:
    """Two datasets of 16 samples, the second's config saying ``mode: pad``."""
    plain, padded = str(tmp_path / "plain"), str(tmp_path / "padded")
    make_dataset(plain, (16,))
    make_dataset(padded, (16,))
    manifest = load_manifest(padded)
    manifest.config = {**manifest.config, "mode": "pad"}
    write_manifest(padded, manifest)
    return plain, padded


def test_every_mixed_batch_has_the_keys_of_every_mixed_dataset(tmp_path):
    # A `mode: pad` dataset's batches carry content_box, another's do not: the mix has one schema, and a
    # sample of the non-pad dataset gets the whole image as its box (what a box-less sample means).
    plain, padded = plain_and_padded(tmp_path)
    datasets = [ShardDataset(plain, 4), ShardDataset(padded, 4)]
    assert "content_box" not in next(iter(datasets[0])) and "content_box" in next(iter(datasets[1]))
    mixed = MixedDataset(datasets, [1, 1], seed=3)
    batches = list(mixed)
    assert {b["__source__"] for b in batches} == {0, 1}
    keys = {frozenset(b) for b in batches}
    assert len(keys) == 1 and "content_box" in next(iter(keys)), keys
    for batch in batches:
        assert batch["content_box"].shape == (4, 4)
        if batch["__source__"] == 0:
            assert batch["content_box"].tolist() == [[0, 0, 8, 8]] * 4


def test_mixed_and_subset_batches_keep_each_samples_source_size_and_crop(tmp_path):
    # A centre-crop dataset written before lines had crops (unknown: -1) mixed with a pad one (nothing cut).
    plain, padded = plain_and_padded(tmp_path)
    mixed = MixedDataset([ShardDataset(plain, 4), ShardDataset(padded, 4)], [1, 1], seed=3)
    batches = list(mixed)
    assert {b["__source__"] for b in batches} == {0, 1}
    for batch in batches:
        assert batch["original_size"].tolist() == [[8, 8]] * 4
        assert batch["crop_top_left"].tolist() == [[-1, -1] if batch["__source__"] == 0 else [0, 0]] * 4
    subset = SubsetDataset(padded, 4, keys=[f"s{i:06d}" for i in (1, 5, 9, 13)])
    assert [b["crop_top_left"].tolist() for b in subset] == [[[0, 0]] * 4]


# --- bucketed datasets: one bucket a batch, whichever dataset it comes from ------------------------------------

@pytest.fixture(scope="module")
def bucketed(tmp_path_factory, encoding: str) -> LayoutDataset:
    return Layout("buckets").make(str(tmp_path_factory.mktemp("mixing-buckets") / "ds"), encoding)


def test_mixing_bucketed_datasets_gives_one_bucket_a_batch(bucketed: LayoutDataset, tmp_path) -> None:
    other = make_bucketed_dataset(str(tmp_path / "other"), buckets=READ_BUCKETS, samples=[5, 7, 11],
                                  samples_per_shard=4)
    a, b = ShardDataset(bucketed.path, 4, shuffle=True), ShardDataset(other, 4, shuffle=True)
    mixed = MixedDataset([a, b], [1, 1], seed=2)
    for batch in mixed:
        source = (a, b)[batch["__source__"]]
        bucket = batch["bucket"]
        image = batch["image"]
        assert image.dtype == torch.uint8 and tuple(image.shape[1:]) == (*source.buckets[bucket], 3)
        keys = batch["__key__"]
        assert len(keys) == image.shape[0] and {key_bucket(k) for k in keys} == {bucket}
        assert pixel_indices(image).tolist() == [key_index(k) for k in keys]
    different = make_bucketed_dataset(str(tmp_path / "different"), buckets=[(8, 12), (12, 8)], samples=[5, 7],
                                      samples_per_shard=4)
    with pytest.raises(DatasetIncompatibleError, match="bucket"):
        MixedDataset([a, ShardDataset(different, 4)], [1, 1])


@pytest.mark.parametrize("epoch, stop", [(0, 7), (2, 3)])
def test_a_mix_of_bucketed_datasets_resumes_at_exactly_the_next_batch(bucketed: LayoutDataset, tmp_path, epoch: int,
                                                                      stop: int) -> None:
    other = make_bucketed_dataset(str(tmp_path / "other"), buckets=READ_BUCKETS, samples=[5, 7, 11],
                                  samples_per_shard=4)
    assert bucketed.sizes == READ_BUCKET_SIZES

    def mixed() -> MixedDataset:
        return MixedDataset([ShardDataset(bucketed.path, 4, shuffle=True), ShardDataset(other, 4, shuffle=True)],
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
