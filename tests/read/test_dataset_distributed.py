"""Ranks and workers: equal batch counts, every sample exactly once per epoch, the rank's order kept; in a
bucketed dataset every rank reads the same bucket at each step, each bucket's rest dealt or dropped alone."""

from __future__ import annotations

import multiprocessing
import os
from collections import Counter

import numpy as np
import pytest
import torch
from bucket_fixtures import make_bucketed_dataset
from dataset_fixtures import assert_exactly_once, indices, make_dataset
from layout_fixtures import READ_BUCKETS, LayoutDataset, batch_bucket, every_key

from shardio import ShardDataset, ShardError, ShardLoader

SAMPLES = 117


@pytest.fixture(scope="module")
def dataset_dir(tmp_path_factory: pytest.TempPathFactory, encoding: str) -> str:
    directory = str(tmp_path_factory.mktemp("distributed"))
    make_dataset(directory, encoding=encoding)
    return directory


def rank_epochs(dataset_dir: str, world_size: int, workers: int, **kwargs) -> list[list[np.ndarray]]:
    """Each simulated rank's batches (as index arrays) for epoch 1."""
    out = []
    for rank in range(world_size):
        ds = ShardDataset(dataset_dir, 5, rank=rank, world_size=world_size, **kwargs)
        ds.set_epoch(1)
        source = ShardLoader(ds, num_workers=workers) if workers else ds
        out.append([indices(b) for b in source])
        assert len(out[-1]) == len(ds)
    return out


def check_split(dataset_dir: str, ranks: list[list[np.ndarray]], world_size: int, drop_last: bool,
                shuffle: bool) -> None:
    assert len({len(batches) for batches in ranks}) == 1, "ranks yield different batch counts"
    seen = np.concatenate([b for batches in ranks for b in batches])
    order = ShardDataset(dataset_dir, 5, shuffle=shuffle).sample_order(1)
    per_round = 5 * world_size
    rest = SAMPLES % per_round
    if drop_last:
        assert_exactly_once(np.concatenate([seen, order[SAMPLES - rest :]]), SAMPLES)
    else:
        repeats = max(0, world_size - rest) if rest else 0
        assert len(seen) == SAMPLES + repeats
        assert_exactly_once(np.unique(seen), SAMPLES)  # none missing
        counts = np.bincount(seen, minlength=SAMPLES)
        assert counts.max() <= 2 and set(np.flatnonzero(counts == 2)) == set(order[:repeats])
    # Rank r's k-th batch is the global batch r + k*W of the epoch order.
    for rank, batches in enumerate(ranks):
        for k, batch in enumerate(batches[: SAMPLES // per_round]):
            g = rank + k * world_size
            assert (batch == order[g * 5 : g * 5 + 5]).all(), f"rank {rank} batch {k} out of order"


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("shuffle", [False, True])
def test_ranks_standalone(dataset_dir: str, world_size: int, drop_last: bool, shuffle: bool) -> None:
    ranks = rank_epochs(dataset_dir, world_size, 0, drop_last=drop_last, shuffle=shuffle)
    check_split(dataset_dir, ranks, world_size, drop_last, shuffle)


@pytest.mark.parametrize("world_size,workers,drop_last", [(1, 2, False), (3, 1, True), (4, 2, False)])
def test_ranks_with_workers(dataset_dir: str, world_size: int, workers: int, drop_last: bool) -> None:
    """Workers split a rank's batches and DataLoader hands them back in the rank's order."""
    ranks = rank_epochs(dataset_dir, world_size, workers, drop_last=drop_last, shuffle=True)
    check_split(dataset_dir, ranks, world_size, drop_last, True)
    alone = rank_epochs(dataset_dir, world_size, 0, drop_last=drop_last, shuffle=True)
    for with_workers, standalone in zip(ranks, alone):
        assert all((a == b).all() for a, b in zip(with_workers, standalone))


def _rank_main(rank: int, world_size: int, dataset_dir: str, store: str, results) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    try:
        ds = ShardDataset(dataset_dir, 5, shuffle=True)
        ds.set_epoch(1)
        results.put((rank, ds.rank, ds.world_size, [indices(b).tolist() for b in ds]))
    except ShardError as error:
        results.put((rank, "error", str(error), []))
    finally:
        dist.destroy_process_group()


def run_ranks(dataset_dirs: list[str], store: str) -> list[tuple]:
    context = multiprocessing.get_context("fork")
    results = context.Queue()
    procs = [context.Process(target=_rank_main, args=(r, len(dataset_dirs), d, store, results))
             for r, d in enumerate(dataset_dirs)]
    for p in procs:
        p.start()
    got = sorted(results.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    return got


def test_rank_from_torch_distributed(dataset_dir: str, tmp_path) -> None:
    """No rank arguments: two gloo processes read rank and world size from torch.distributed."""
    got = run_ranks([dataset_dir, dataset_dir], os.path.join(tmp_path, "store"))
    assert [(r, rank, ws) for r, rank, ws, _ in got] == [(0, 0, 2), (1, 1, 2)]
    ranks = [[np.array(b) for b in batches] for *_, batches in got]
    check_split(dataset_dir, ranks, 2, False, True)


def test_plain_dataloader(dataset_dir: str) -> None:
    """The issue's spelling works too: DataLoader(ds, batch_size=None, num_workers=k, pin_memory=...)."""
    from torch.utils.data import DataLoader

    ds = ShardDataset(dataset_dir, 5, shuffle=True, rank=1, world_size=2)
    expected = [indices(b).tolist() for b in ds]
    ds.set_epoch(0)  # the workers' copies cannot advance the epoch: a plain DataLoader needs set_epoch
    loader = DataLoader(ds, batch_size=None, num_workers=2, pin_memory=torch.cuda.is_available())
    assert [indices(b).tolist() for b in loader] == expected


def test_ranks_on_different_snapshots_refuse(dataset_dir: str, tmp_path) -> None:
    """A rank that opened another snapshot (the writer committed in between) would hang DDP: all refuse."""
    other = str(tmp_path / "other")
    make_dataset(other, (40, 45, 31))
    got = run_ranks([dataset_dir, other], os.path.join(tmp_path, "store"))
    assert [r[1] for r in got] == ["error", "error"]
    assert all("manifest.json" in r[2] and "different snapshots" in r[2] for r in got)


def test_a_rank_that_cannot_open_fails_them_all(dataset_dir: str, tmp_path) -> None:
    """Rank 1 finds a truncated shard; rank 0 must not go on to wait for it in the first collective."""
    broken = str(tmp_path / "broken")
    make_dataset(broken)
    shard = os.path.join(broken, "shards", "input-0-00000.npy")
    os.truncate(shard, os.path.getsize(shard) - 1)
    got = run_ranks([dataset_dir, broken], os.path.join(tmp_path, "store"))
    assert [r[1] for r in got] == ["error", "error"]
    assert "rank 1 could not open" in got[0][2] and "input-0-00000.npy" in got[0][2]
    assert "truncated" in got[1][2]


# --- one shape a step: a bucketed dataset's ranks in step (a single-shape dataset is one bucket) ---------------

@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("drop_last", [False, True])
def test_ranks_take_the_same_bucket_at_each_step(layout_dataset: LayoutDataset, world_size: int,
                                                 drop_last: bool) -> None:
    data, batch_size = layout_dataset, 4
    ranks = [ShardDataset(data.path, batch_size, shuffle=True, seed=1, rank=r, world_size=world_size,
                          drop_last=drop_last) for r in range(world_size)]
    for ds in ranks:
        ds.set_epoch(2)
    epochs = [list(ds) for ds in ranks]
    assert len({len(e) for e in epochs}) == 1 and len(epochs[0]) == len(ranks[0])
    seen = Counter()
    for step in range(len(epochs[0])):
        buckets = set()
        for r in range(world_size):
            data.check(epochs[r][step])
            buckets.add(batch_bucket(epochs[r][step]))
        assert len(buckets) == 1, f"step {step}: ranks read buckets {buckets}"
        for r in range(world_size):
            seen.update(epochs[r][step]["__key__"])
    every = every_key(ranks[0])
    per_round = batch_size * world_size
    if drop_last:  # each bucket's rest is dropped: exactly those samples are missing, the others once
        assert set(seen.values()) == {1} and set(seen) <= set(every)
        assert len(every) - len(seen) == sum(n % per_round for n in data.sizes)
    else:  # every sample; a rank left with nothing in a bucket's short round repeats one of its samples
        assert set(seen) == set(every)
        repeats = sum(seen.values()) - len(every)
        assert repeats == sum(max(0, world_size - n % per_round) for n in data.sizes if n % per_round)


def test_workers_keep_order_and_counts(layout_dataset: LayoutDataset) -> None:
    data = layout_dataset
    direct = [b["__key__"] for b in ShardDataset(data.path, 4, shuffle=True, seed=3)]
    ds = ShardDataset(data.path, 4, shuffle=True, seed=3)
    loader = ShardLoader(ds, num_workers=2)
    through = []
    for batch in loader:
        through.append(batch["__key__"])
        assert tuple(batch["image"].shape[1:3]) == ds.buckets[batch_bucket(batch)]
    assert through == direct
    assert ds.batches_seen == len(ds)


def test_an_empty_bucket_takes_no_round(tmp_path) -> None:
    directory = make_bucketed_dataset(str(tmp_path), buckets=READ_BUCKETS, samples=[9, 0, 6], samples_per_shard=4)
    for drop_last in (False, True):
        ranks = [ShardDataset(directory, 2, shuffle=True, rank=r, world_size=2, drop_last=drop_last) for r in range(2)]
        assert ranks[0].bucket_sizes == [9, 0, 6]
        epochs = [list(ds) for ds in ranks]
        assert len(epochs[0]) == len(epochs[1]) == len(ranks[0]) == (2 + 1 if drop_last else 3 + 2)
        for a, b in zip(*epochs):
            assert a["bucket"] == b["bucket"] != 1


def test_drop_last_with_no_full_round_in_any_bucket_is_refused(tmp_path, encoding: str) -> None:
    directory = make_bucketed_dataset(str(tmp_path), buckets=READ_BUCKETS, samples=[23, 41, 9], samples_per_shard=6,
                                      encoding=encoding)
    with pytest.raises(ValueError, match="in any bucket"):
        ShardDataset(directory, 16, world_size=3, rank=0, drop_last=True)  # 48 a round, buckets of 23, 41, 9
