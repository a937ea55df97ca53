"""``SubsetDataset``: a ``ShardDataset`` over chosen samples: by key, by source input, or a fraction.

A subset is a view, never a copy: ``shardio.read.selection`` narrows every snapshot the dataset opens to
the chosen samples, as segments of the shards' memory maps. So shuffling, batching across segments,
ranks, workers, prefetch, ``state_dict`` (and a resume that reopens the state's generation) and
augmentation positions are exactly ``ShardDataset``'s, on the subset's samples in stored order.
Segments cost a few µs each per batch (a short copy each): a fraction of 0.5 of a dataset cuts every
shard into ~N/4 segments; fine for training-set subsets, slower per sample than whole shards for tiny
images.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from shardio.read.dataset import ShardDataset
from shardio.read.selection import SampleSelection, SubsetSnapshot, fraction_member, select_samples

__all__ = ["SampleSelection", "SubsetDataset", "SubsetSnapshot", "fraction_member", "select_samples"]


class SubsetDataset(ShardDataset):
    """``ShardDataset(path, batch_size, selection=SampleSelection(keys, inputs, fraction, fraction_seed))``
    (see ``shardio.read.selection``); every other argument is ``ShardDataset``'s. ``len(ds.snapshot)`` is the
    subset's size and ``ds.snapshot.selected`` its samples' stored indices in the full dataset."""

    def __init__(self, path: str, batch_size: int, *, keys: Iterable[str] | None = None,
                 inputs: Iterable[str] | None = None, fraction: float | None = None,
                 fraction_seed: int = 0, **kwargs: Any) -> None:
        selection = SampleSelection(keys=None if keys is None else tuple(keys),
                                    inputs=None if inputs is None else tuple(inputs),
                                    fraction=fraction, fraction_seed=int(fraction_seed))
        super().__init__(path, batch_size, selection=selection, **kwargs)
