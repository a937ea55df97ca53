"""The shard cache plans a pass a horizon ahead (shardio/read/cache/cache_plan.py): what it keeps and what each step
costs are bounded by the horizon, never by the pass, and within the horizon it knows every next use as the whole
pass's plan would. A 200k-shard synthetic index and a pass of ten million steps for the scale; a small real dataset
read through a folder posing as the store for the bytes."""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import numpy as np
import pytest

from bench.synthetic_index import write_index
from shardio.errors import ShardError
from shardio.format.manifests import load_index
from shardio.read.cache import cache_plan
from shardio.read.cache.cache_plan import PlannedPass
from shardio.read.cache.cache_units import ShardUnits
from shardio.read.cache.shard_cache import ShardCache
from tests.read.test_cache_lazy import NeverStore
from tests.read.test_shard_cache import FolderStore, dataset, local_pixels, read_all, units_of  # noqa: F401

SHARDS = 200_000
SHAPE = (2, 2, 3)


class CountedSteps(Sequence[list[int]]):
    """A pass of ``steps`` steps computed when asked (as ``PassShards`` computes them), each ``width`` shards drawn
    from a window of ``window`` shards that moves on every ``per_window`` steps; records the last step asked for."""

    def __init__(self, steps: int, width: int = 3, window: int = 64, per_window: int = 40) -> None:
        self.steps, self.width, self.window, self.per_window = steps, width, window, per_window
        self.furthest = -1

    def __len__(self) -> int:
        return self.steps

    def __getitem__(self, index):  # type: ignore[override]
        if isinstance(index, slice):
            raise TypeError("asked for a slice: the cache must take steps one at a time")
        if not 0 <= index < self.steps:
            raise IndexError(index)
        self.furthest = max(self.furthest, index)
        first = (index // self.per_window) * self.window % SHARDS
        rng = np.random.default_rng(index)
        return [(first + int(s)) % SHARDS for s in rng.choice(self.window, self.width, replace=False)]


@pytest.fixture(scope="module")
def big_table(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("big"))
    write_index(directory, SHARDS)
    return directory, load_index(directory).shards


def whole_next_use(sequence: list[str], key: str, after: int) -> float:
    uses = [i for i, k in enumerate(sequence) if k == key]
    i = bisect.bisect_left(uses, after)
    return uses[i] if i < len(uses) else float("inf")


def test_a_planned_pass_knows_each_next_use_within_its_horizon_as_the_whole_plan(monkeypatch):
    monkeypatch.setattr(cache_plan, "FORGET_ENTRIES", 8)
    steps = CountedSteps(400, width=4, window=12, per_window=10)
    whole: list[str] = []
    for number in range(len(steps)):
        keys = [str(s) for s in steps[number]]
        whole += [k for i, k in enumerate(keys) if not i or keys[i - 1] != k]
    planned = PlannedPass(steps, str, lambda key: 10)
    assert planned.grow(150, limit=10**9) is None and planned.batches == 150
    forgotten = planned.forget(60)
    assert planned.base_batch == 60 and planned.base == planned.start(60) == 240
    assert all(key not in planned.uses for key in forgotten)
    assert all(whole_next_use(whole, key, 240) >= planned.end for key in forgotten)  # not read again in the horizon
    for after in (240, 333, 599):
        for key in {whole[i] for i in range(0, 800, 7)}:
            expected = whole_next_use(whole, key, after)
            got = planned.next_use(key, after)
            assert got == (expected if expected < planned.end else float("inf")), (key, after)
    assert planned.window_bytes == 10 * len(set(whole[240:planned.end]))
    assert planned.keys(240, 250) == whole[240:250] and planned.key(599) == whole[599]
    assert planned.first_batch_from(241) == 61 and planned.first_batch_from(10**9) == planned.batches


def test_processes_planning_the_same_steps_in_different_chunks_agree_on_the_digest():
    one, other = PlannedPass(CountedSteps(100), str, len), PlannedPass(CountedSteps(100), str, len)
    one.grow(100, 10**9)
    for _ in range(20):
        other.grow(7, 10**9)
        other.forget(other.batches)
    shorter = PlannedPass(CountedSteps(99), str, len)
    shorter.grow(99, 10**9)
    assert one.complete and other.complete and shorter.complete and one.digest == other.digest != shorter.digest


def test_a_step_over_the_limit_is_not_planned_and_says_so():
    planned = PlannedPass([[1], [2], [3, 4, 5], [6]], str, lambda key: 10)
    assert planned.grow(10, limit=25) == (30, 3, 3)
    assert planned.batches == 2 and not planned.complete


def test_planning_a_pass_costs_its_horizon_not_the_pass(big_table, tmp_path, monkeypatch):
    """Ten million steps over 200,000 shards: the plan asks for the steps it reaches, keeps about ``AHEAD_ENTRIES``
    entries and the units they name, whatever has been read before."""
    monkeypatch.setattr(cache_plan, "AHEAD_ENTRIES", 3_000)
    monkeypatch.setattr(cache_plan, "FORGET_ENTRIES", 500)
    directory, table = big_table
    steps = CountedSteps(10_000_000)
    cache = ShardCache(ShardUnits(directory, table), NeverStore(), str(tmp_path / "cache"), 10**12, shape=SHAPE,
                       threads=0)
    try:
        cache.plan(steps)
        assert steps.furthest < 2 * cache_plan.GROW_STEPS
        for batch in range(0, 20_000, 3):  # a DataLoader worker's share: every third step
            cache.advance(batch)
            planned = cache._pass
            assert planned.end - cache._position <= cache_plan.AHEAD_ENTRIES + 3 * cache_plan.GROW_STEPS
            assert planned.end - planned.base <= 2 * cache_plan.AHEAD_ENTRIES + 3 * cache_plan.FORGET_ENTRIES
            assert len(cache._units) <= len(planned.uses) and len(cache._by_key) <= len(planned.uses)
        assert 20_000 < steps.furthest < 20_000 + cache_plan.AHEAD_ENTRIES
    finally:
        cache.close()


def test_the_horizon_stops_at_what_the_cache_could_hold(big_table, tmp_path):
    directory, table = big_table
    size = table[0].bytes + table[0].meta_bytes
    limit = 400 * size  # 400 shards of 200,000: the horizon holds a little more than that, not AHEAD_ENTRIES
    cache = ShardCache(ShardUnits(directory, table), NeverStore(), str(tmp_path / "cache"), limit, shape=SHAPE,
                       threads=0)
    try:
        cache.plan(CountedSteps(10_000_000))
        for batch in range(2_000):
            cache.advance(batch)
            planned = cache._pass
            assert planned.window_bytes <= limit + planned.largest + cache_plan.GROW_STEPS * 3 * size
        assert planned.window_bytes >= limit
        assert cache._pass.end - cache._position < cache_plan.AHEAD_ENTRIES
    finally:
        cache.close()


def test_a_step_too_large_is_refused_where_the_plan_reaches_it(dataset, tmp_path):  # noqa: F811
    units, shape = units_of(dataset)
    limit = 3 * max(u.size for u in units)
    steps = [[0], [1], [2], [3], [4], [5], [6], [7], [8], [9], [10], [11], [12], [13], [14], [0, 1, 2, 3]]
    cache = ShardCache(units, FolderStore(dataset), str(tmp_path / "cache"), limit, shape=shape, threads=1)
    try:
        cache.plan(steps)  # the first steps fit: the pass begins
        with pytest.raises(ShardError, match=r"needs 4 shards .* over cache_limit"):
            for batch in range(len(steps)):
                cache.advance(batch)
                cache.pixels(steps[batch][0])
    finally:
        cache.close()


@pytest.mark.parametrize("ahead", [4, 1_000])
def test_windows_read_through_a_short_horizon_come_whole_and_within_the_limit(dataset, tmp_path,  # noqa: F811
                                                                              monkeypatch, ahead):
    """Windows of three shards read in a shuffled order, a cache of two windows: with a horizon of a few entries
    (the shards of a window it does not see yet count as not read again) every byte is right and the limit holds; with
    one as long as the cache each shard is fetched once, as with the whole pass planned."""
    monkeypatch.setattr(cache_plan, "AHEAD_ENTRIES", ahead)
    monkeypatch.setattr(cache_plan, "FORGET_ENTRIES", 2)
    units, shape = units_of(dataset)
    cache_dir = str(tmp_path / "cache")
    store = FolderStore(dataset, cache_dir)
    limit = 6 * max(u.size for u in units)
    rng = np.random.default_rng(3)
    sequence = [int(s) for w in range(0, len(units), 3) for s in rng.integers(w, w + 3, size=12)]
    cache = ShardCache(units, store, cache_dir, limit, shape=shape, threads=2)
    try:
        got = read_all(cache, sequence)
        for shard, data in zip(sequence, got):
            assert data[: local_pixels(dataset, units[shard]).nbytes] == local_pixels(dataset, units[shard]).tobytes()
        assert 0 < cache.stats["peak_bytes"] <= limit and max(store.sizes) <= limit
        if ahead >= len(sequence):
            assert cache.stats["downloads"] == len(set(sequence))
    finally:
        cache.close()


def fresh_keep(planned: PlannedPass, start: int, budget: int, size_of) -> set[str]:
    keep: set[str] = set()
    total = 0
    for key in planned.keys(start, planned.end):
        if key not in keep:
            if total + size_of(key) > budget:
                break
            keep.add(key)
            total += size_of(key)
    return keep


def test_the_keep_set_followed_step_by_step_is_the_one_counted_afresh(monkeypatch):
    """The group's keep set, kept up to date as the slowest reader and the horizon move (``KeepSet``), is at every
    step the set counted from scratch there: the distinct keys from that place on, as many as the budget takes."""
    monkeypatch.setattr(cache_plan, "FORGET_ENTRIES", 16)
    from shardio.read.cache.cache_plan import KeepSet

    def size_of(key: str) -> int:
        return 5 + int(key) % 7  # shards of different sizes

    planned = PlannedPass(CountedSteps(3_000, width=5, window=20, per_window=6), str, size_of)
    planned.grow(20, 10**9)
    kept = KeepSet()
    rng = np.random.default_rng(0)
    batch = 0
    for _ in range(600):
        batch = min(batch + int(rng.integers(0, 4)), planned.batches - 1)  # the slowest moves on, or waits
        if rng.random() < 0.5:
            planned.grow(int(rng.integers(1, 6)), 10**9)  # the horizon grows
        if rng.random() < 0.2:
            planned.forget(batch)
        budget = 200 if rng.random() < 0.9 else 120  # a follower's budget changes as its largest step does
        start = planned.start(batch)
        assert kept.update(planned, start, budget, size_of) == fresh_keep(planned, start, budget, size_of)


def test_a_remote_pass_through_a_horizon_of_a_few_entries_reads_the_local_copys_batches(cloud_bucket, tmp_path,
                                                                                      monkeypatch):
    """The reader end to end (``ShardDataset`` on each cloud's emulator, two epochs, a cache of a third of the
    dataset) with a horizon of a few entries, grown a step at a time by the reader and the download threads and
    forgotten behind it: the same batches as the local copy, and the limit kept."""
    import torch

    from shardio.format.manifests import load_manifest
    from shardio.read.dataset import ShardDataset
    from tests.dataset_fixtures import make_dataset

    monkeypatch.setattr(cache_plan, "AHEAD_ENTRIES", 6)
    monkeypatch.setattr(cache_plan, "GROW_STEPS", 1)
    monkeypatch.setattr(cache_plan, "FORGET_ENTRIES", 3)
    local = str(tmp_path / "local")
    make_dataset(local, inputs=(40, 45, 32), samples_per_shard=8, height=16, width=16)  # 15 shards
    url = cloud_bucket.upload_dir(local)
    limit = 5 * max(e.bytes + e.meta_bytes for e in load_manifest(local).shards)
    settings = {"shuffle": True, "seed": 3, "shuffle_window": 2, "shuffle_block": 2, "drop_last": False}
    remote = ShardDataset(url, 4, cache_dir=str(tmp_path / "cache"), cache_limit=limit, **settings)
    local_ds = ShardDataset(local, 4, **settings)
    for epoch in (0, 1):
        remote.set_epoch(epoch)
        local_ds.set_epoch(epoch)
        expected, got = list(local_ds), list(remote)
        assert len(got) == len(expected) == 30  # 117 samples in batches of 4
        for a, b in zip(expected, got):
            assert torch.equal(a["image"], b["image"]) and a["__key__"] == b["__key__"]
        planned = remote._cache._pass
        assert planned.complete and planned.base > 0  # planned a few steps at a time, forgotten behind the reader
    stats = remote.cache_stats()
    assert 0 < stats["peak_bytes"] <= limit and stats["downloads"] >= 15
