"""A bucketed dataset under real DDP: two CPU processes under torchrun (gloo) train one epoch with
``ShardDataModule``; at every step both ranks train on a batch of the same bucket, at that bucket's shape, on
disjoint samples that together are the epoch less each bucket's rest (``drop_last`` per bucket)."""

from __future__ import annotations


import pytest
from bucket_fixtures import key_bucket, make_bucketed_dataset

from tests.lightning_ddp_worker import run_ranks

BUCKETS = [(8, 12), (12, 8), (10, 10)]
SIZES = [37, 29, 21]
BATCH, WORLD = 8, 2  # ShardDataModule(path, 8, drop_last=True) in tests/lightning_ddp_worker.py


@pytest.fixture(scope="module")
def bucketed(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_bucketed_dataset(str(tmp_path_factory.mktemp("ddp-buckets") / "ds"), buckets=BUCKETS,
                                 samples=SIZES, samples_per_shard=6)


def test_torchrun_ranks_train_the_same_bucket_at_every_step_on_disjoint_samples(bucketed: str, tmp_path) -> None:
    ranks = run_ranks(bucketed, str(tmp_path), "buckets", world=WORLD)
    assert [(r["rank"], r["world"]) for r in ranks] == [(0, WORLD), (1, WORLD)]
    steps = [r["seen"] for r in ranks]
    rounds = [n // (BATCH * WORLD) for n in SIZES]  # drop_last: each bucket's full rounds only
    assert len(steps[0]) == len(steps[1]) == sum(rounds)
    for step, (first, second) in enumerate(zip(*steps)):
        assert first[0] == second[0], f"step {step}: rank 0 bucket {first[0]}, rank 1 bucket {second[0]}"
        bucket = first[0]
        for _, shape, keys in (first, second):
            assert tuple(shape) == BUCKETS[bucket] and len(keys) == BATCH
            assert {key_bucket(k) for k in keys} == {bucket}
    keys = [[k for _, _, ks in rank for k in ks] for rank in steps]
    assert not set(keys[0]) & set(keys[1]) and all(len(set(k)) == len(k) for k in keys)
    per_bucket = [sum(1 for k in keys[0] + keys[1] if key_bucket(k) == b) for b in range(len(BUCKETS))]
    assert per_bucket == [n * BATCH * WORLD for n in rounds]  # every bucket's rest, and only that, dropped
    assert [sum(1 for s in steps[0] if s[0] == b) for b in range(len(BUCKETS))] == rounds
