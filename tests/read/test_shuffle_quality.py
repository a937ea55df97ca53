"""Shuffle quality (``shardio.read.shuffle_quality``): the metric itself, and the default order within its
stated margin of a uniform permutation (docs/reader.md): on 200 shards of 1,000 samples in batches of 256,
mean distinct shards per batch >= 90% of a permutation's and stored neighbours in <= 1% of a batch's pairs."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from dataset_fixtures import make_dataset

from shardio import ShardDataset
from shardio.read.order import epoch_runs
from shardio.read.shuffle_quality import permutation_quality, runs_order, shuffle_quality

SHARDS, PER_SHARD, BATCH = 200, 1000, 256


@pytest.fixture(scope="module")
def layout() -> tuple[np.ndarray, np.ndarray]:
    """200 shards of 1,000 samples (counts only: the order never reads pixels), and each sample's shard."""
    counts = np.full(SHARDS, PER_SHARD)
    return counts, np.repeat(np.arange(SHARDS), PER_SHARD)


@pytest.fixture(scope="module")
def default_settings(tmp_path_factory: pytest.TempPathFactory) -> dict[str, int]:
    """The order settings a ShardDataset gets when the caller leaves them out."""
    directory = str(tmp_path_factory.mktemp("quality"))
    make_dataset(directory)
    ds = ShardDataset(directory, BATCH, shuffle=True)
    return {"shuffle_window": ds.shuffle_window, "shuffle_block": ds.shuffle_block}


def test_stored_order_is_one_source_and_all_neighbours(layout) -> None:
    counts, source = layout
    quality = shuffle_quality(np.arange(counts.sum()), source, BATCH)
    assert quality.batches == SHARDS * PER_SHARD // BATCH
    # A batch of 256 inside one shard of 1,000, or across the boundary of two.
    assert 1 < quality.sources_per_batch < 1.3
    assert quality.neighbours_per_batch == BATCH - 1 and quality.neighbour_rate == 1.0


def test_counts_on_a_small_order() -> None:
    source = np.array([0, 0, 0, 1, 1, 2, 2, 2])
    order = np.array([0, 3, 5, 1, 2, 4, 7, 6])  # {0,1,3,5}: sources 0,1,2, pair 0-1; {2,4,6,7}: 0,1,2, 6-7
    quality = shuffle_quality(order, source, 4)
    assert (quality.batches, quality.sources_per_batch, quality.neighbours_per_batch) == (2, 3.0, 1.0)
    assert quality.neighbour_rate == pytest.approx(1 / 3)
    assert shuffle_quality(np.array([0, 1, 2, 3, 4, 5, 6, 7]), source, 4).neighbours_per_batch == 3


def test_permutation_expectation_is_exact_on_a_small_case() -> None:
    """Every permutation of 7 samples in sources of 3, 2, 2, cut into batches of 3: the average over all
    5,040 equals the closed form."""
    sizes = np.array([3, 2, 2])
    source = np.repeat(np.arange(3), sizes)
    measured = [shuffle_quality(np.array(p), source, 3) for p in itertools.permutations(range(7))]
    expected = permutation_quality(sizes, 3)
    assert np.mean([q.sources_per_batch for q in measured]) == pytest.approx(expected.sources_per_batch)
    assert np.mean([q.neighbours_per_batch for q in measured]) == pytest.approx(expected.neighbours_per_batch)
    assert expected.sources_per_batch == pytest.approx(3 - (math.comb(4, 3) + 2 * math.comb(5, 3)) / 35)


def test_a_random_permutation_measures_what_the_expectation_says(layout) -> None:
    counts, source = layout
    expected = permutation_quality(counts, BATCH)
    measured = shuffle_quality(np.random.default_rng(1).permutation(counts.sum()), source, BATCH)
    assert measured.sources_share(expected) == pytest.approx(1.0, abs=0.01)  # 781 batches: sd ~0.002
    assert expected.neighbours_per_batch == pytest.approx(BATCH * (BATCH - 1) / counts.sum())


def test_runs_order_expands_runs() -> None:
    counts = np.array([3, 0, 4])
    runs = np.array([[2, 1, 3], [0, 0, 2], [2, 0, 1], [0, 2, 3], [2, 3, 4]])
    assert runs_order(runs, counts).tolist() == [4, 5, 0, 1, 3, 2, 6]


@pytest.mark.parametrize("epoch", [0, 1])
def test_default_order_is_within_the_margin_of_a_permutation(layout, default_settings, epoch) -> None:
    counts, source = layout
    runs = epoch_runs(counts, shuffle=True, seed=0, epoch=epoch, **default_settings)
    quality = shuffle_quality(runs_order(runs, counts), source, BATCH)
    reference = permutation_quality(counts, BATCH)
    assert quality.sources_share(reference) >= 0.9, quality
    assert quality.neighbour_rate <= 0.01, quality


def test_larger_datasets_mix_a_window_of_shards_per_batch() -> None:
    """2,000 shards, more than a window: each batch draws from one window of 256 shards, about
    256 (1 - e^-1) = 162 distinct ones (Mosaic's py1e at its default block: 161, bench.shuffle)."""
    counts = np.full(2000, PER_SHARD)
    runs = epoch_runs(counts, shuffle=True, seed=0, epoch=0, shuffle_window=256, shuffle_block=1)
    quality = shuffle_quality(runs_order(runs, counts), np.repeat(np.arange(2000), PER_SHARD), BATCH)
    assert 150 < quality.sources_per_batch < 175 and quality.neighbour_rate <= 0.01
