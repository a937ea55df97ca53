"""The dataset layout as a test dimension, beside ``encoding``: ``single`` (one shape, ``tests.dataset_fixtures``)
or ``buckets`` (aspect-ratio buckets, format version 4, ``tests.bucket_fixtures``). A test that checks one
behaviour on both takes the ``layout`` fixture (tests/conftest.py) and makes its dataset with
``layout.make(directory, encoding)``; what differs is data on the returned ``LayoutDataset``, not a branch in
the test.

A single-shape dataset reads as one bucket: ``shapes`` is its one shape and ``sizes`` its sample count, as
``ShardDataset.buckets`` and ``bucket_sizes`` say. Samples identify themselves in both layouts (pixels,
label and key carry the sample's number): ``check`` reads a batch's numbers back and checks the batch is
one shape, its bucket's.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np

from bucket_fixtures import bucket_order, make_bucketed_dataset
from dataset_fixtures import AWKWARD_INPUTS, indices, make_dataset

__all__ = ["LAYOUTS", "Layout", "LayoutDataset", "batch_bucket", "every_key", "lockstep", "counted", "sample_number",
           "READ_BUCKETS", "READ_BUCKET_SIZES"]

LAYOUTS = ("single", "buckets")

# The reader suites' bucketed dataset: 73 samples in three shapes, shards of 6, so every bucket ends in a
# partial shard and no bucket is a multiple of a batch of 4.
READ_BUCKETS = [(8, 12), (12, 8), (10, 10)]
READ_BUCKET_SIZES = [23, 41, 9]


def sample_number(key: str) -> int:
    """The sample number a fixture key names: ``s{i:06d}`` (single shape) or ``b{bucket}-{g:06d}``."""
    return int(key[1:]) if key.startswith("s") else int(key[key.index("-") + 1:])


def every_key(dataset) -> Counter:
    """Each key of a ``ShardDataset``'s samples, read by sample access (once each, unless the dataset repeats
    one)."""
    return Counter(dataset.sample(i)["__key__"] for i in range(dataset.num_samples))


def batch_bucket(batch: dict[str, Any]) -> int:
    """The bucket a batch says it is of; a single-shape batch names none and is bucket 0."""
    return int(batch.get("bucket", 0))


def lockstep(datasets: list, steps: int | None = None) -> list[list[list[str]]]:
    """Each rank's batches' keys, the ranks (``ShardDataset``s of one dataset) stepping together
    (``steps``: that many, else to the end); at every step the ranks read one bucket."""
    iterators = [iter(ds) for ds in datasets]
    out: list[list[list[str]]] = [[] for _ in datasets]
    step = 0
    while steps is None or step < steps:
        try:
            batches = [next(it) for it in iterators]
        except StopIteration:
            break
        assert len({batch_bucket(b) for b in batches}) == 1
        for rank, batch in enumerate(batches):
            out[rank].append(batch["__key__"])
        step += 1
    return out


def counted(steps: list[list[list[str]]]) -> Counter:
    """How often each key comes in ``lockstep``'s batches."""
    return Counter(k for batches in steps for batch in batches for k in batch)


@dataclass(frozen=True)
class LayoutDataset:
    """A written test dataset and what a reader must find in it."""

    path: str
    layout: str
    encoding: str
    shapes: list[tuple[int, int]]  # ShardDataset.buckets: the one shape of a single-shape dataset
    sizes: list[int]  # ShardDataset.bucket_sizes

    @property
    def bucketed(self) -> bool:
        return self.layout == "buckets"

    @property
    def samples(self) -> int:
        return sum(self.sizes)

    @cached_property
    def _buckets_in_writing_order(self) -> list[int]:
        return bucket_order(self.sizes) if self.bucketed else [0] * self.samples

    def bucket_of(self, number: int) -> int:
        """The bucket of sample ``number`` (its writing order: ``bucket_fixtures.bucket_order``)."""
        return self._buckets_in_writing_order[number]

    def stored_numbers(self, dataset) -> np.ndarray:
        """The sample number at each stored index of ``dataset`` (a ``ShardDataset`` of this one): the index
        itself in a single-shape dataset; a bucketed dataset's writer groups each input's samples by bucket,
        so there it is read from the keys."""
        if not self.bucketed:
            return np.arange(self.samples)
        return np.array([sample_number(dataset.sample(i)["__key__"]) for i in range(dataset.num_samples)])

    def shape_counts(self) -> Counter:
        """How many samples each shape has."""
        return Counter({shape: n for shape, n in zip(self.shapes, self.sizes) if n})

    def check(self, batch: dict[str, Any]) -> np.ndarray:
        """The sample numbers of ``batch`` (pixels, labels and keys agree: ``dataset_fixtures.indices``); its
        image is one bucket's shape and every sample is of that bucket. A single-shape batch carries no
        ``bucket``."""
        found = indices(batch)
        if self.bucketed:
            assert "bucket" in batch, "a bucketed dataset's batch names its bucket"
        else:
            assert "bucket" not in batch, "a single-shape batch has no bucket key"
        bucket = batch_bucket(batch)
        assert tuple(batch["image"].shape[1:3]) == tuple(self.shapes[bucket])
        assert [self.bucket_of(int(i)) for i in found] == [bucket] * len(found), "one bucket a batch"
        return found


@dataclass(frozen=True)
class Layout:
    """What the ``layout`` fixture gives: the layout's name and a maker of its self-identifying dataset."""

    name: str

    def __str__(self) -> str:
        return self.name

    @property
    def bucketed(self) -> bool:
        return self.name == "buckets"

    def make(self, directory: str, encoding: str = "raw", *, inputs: tuple[int, ...] = AWKWARD_INPUTS,
             buckets: list[tuple[int, int]] = READ_BUCKETS, sizes: list[int] = READ_BUCKET_SIZES,
             samples_per_shard: int | None = None) -> LayoutDataset:
        """Write this layout's dataset into ``directory``: single shape, ``inputs`` (117 samples of 8x8 in
        shards of 8 by default); buckets, ``sizes[b]`` samples of ``buckets[b]``'s shape (23, 41 and 9 in
        shards of 6 by default) over two inputs."""
        if self.bucketed:
            make_bucketed_dataset(directory, buckets=buckets, samples=sizes, samples_per_shard=samples_per_shard or 6,
                                  encoding=encoding)
            return LayoutDataset(directory, self.name, encoding, [tuple(b) for b in buckets], list(sizes))
        make_dataset(directory, inputs, samples_per_shard=samples_per_shard or 8, encoding=encoding)
        return LayoutDataset(directory, self.name, encoding, [(8, 8)], [sum(inputs)])
