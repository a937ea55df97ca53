"""A dataset's layout, chosen once when a snapshot is opened: one shape, or aspect-ratio buckets.

Everything the reader does differently for the two asks the snapshot's ``Layout`` (``layout_of``, the one
place that looks at which it is): the epoch's order (``plan``, ``runs``), this rank's batches
(``rank_batches``) and their count (``batches_per_epoch``), how many orders take turns and so how many
windows of maps to keep (``turns``), what a batch carries and the least its buffer holds, and a resume
state's place (``seek``, ``begin``, ``position``, the state's keys, ``resume``: ``shardio.read.resume``
owns the protocol and asks these). The two rows:

- ``shardio.read.one_shape.OneShape``: every sample one (H, W); one order over all the shards
  (``shardio.read.order``), a state is a global position.
- ``shardio.read.bucket_order.Buckets`` (``mode: bucket``, format version 4): each bucket its own order,
  rounds of one bucket a step, a state adds the samples consumed per bucket.

A single shape is the one-bucket case of the same questions: ``shapes`` is ``((H, W),)`` and ``sizes``
``(samples,)``, as ``ShardDataset.buckets`` and ``bucket_sizes`` report them. Like FFCV's loader, which
picks its traversal order from a table once in ``Loader.__init__``, nothing after the open asks again.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from shardio.read.bucket_order import Buckets
from shardio.read.epoch_plan import Piece
from shardio.read.one_shape import OneShape
from shardio.read.order import Deal

__all__ = ["EpochOrder", "Layout", "layout_of", "mix_refusal"]

Shape = tuple[int, int]


class EpochOrder(Protocol):
    """One epoch's order (``EpochPlan``, ``BucketPlan``): the slices holding a range of epoch positions."""

    def pieces(self, positions: range) -> list[Piece]: ...

    def runs(self) -> np.ndarray: ...


class Layout(Protocol):
    """What the reader asks of a dataset's layout (module docstring). A value of a few ints, the same on
    every rank and worker for one snapshot."""

    @property
    def shapes(self) -> tuple[Shape, ...]:
        """(h, w) of each bucket, by id; one shape: ``((H, W),)``."""

    @property
    def sizes(self) -> tuple[int, ...]:
        """Samples of each bucket (of the selection); one shape: ``(samples,)``."""

    @property
    def samples(self) -> int: ...

    @property
    def turns(self) -> int:
        """Orders that take turns in an epoch, each reading its own shuffle window: keep maps for each."""

    @property
    def largest(self) -> int:
        """Samples of the largest order a full round of ``drop_last`` is cut from."""

    where_full: str  # said after "make no full batch ... on each of W ranks" (drop_last refusing a dataset)
    batch_defaults: dict[str, Any]  # the keys every batch of this layout has, as a mix fills them

    def plan(self, snapshot: Any, **order: Any) -> EpochOrder: ...

    def runs(self, snapshot: Any, **order: Any) -> np.ndarray: ...

    def rank_batches(self, deal: Deal, epoch: int) -> Sequence[range]: ...

    def batches_per_epoch(self, batch_size: int, world_size: int, drop_last: bool) -> int: ...

    def buffer_bytes(self, batch_size: int) -> int: ...

    def batch_shape(self, snapshot: Any, shard: int) -> Shape: ...

    def batch_fields(self, snapshot: Any, shard: int) -> dict[str, Any]: ...

    def seek(self, deal: Deal, epoch: int, batches: int) -> dict[str, Any]: ...

    def has_left(self, deal: Deal, pending: dict[str, Any]) -> bool: ...

    def begin(self, deal: Deal, epoch: int, start: int,
              pending: dict[str, Any] | None) -> tuple[int, Sequence[range], int]: ...

    def position(self, deal: Deal, start: int, batches: Any, handed: int) -> int: ...

    def start_state(self) -> dict[str, Any]: ...

    def pass_state(self, batches: Any, handed: int) -> dict[str, Any]: ...

    def pending_state(self, pending: dict[str, Any]) -> dict[str, Any]: ...

    def resume(self, state: dict[str, Any], batches_seen: int, batch_size: int, world_size: int,
               drop_last: bool, where: str) -> tuple[int, int, dict[str, Any]]: ...


def layout_of(snapshot: Any) -> Layout:
    """The layout of ``snapshot`` (a ``DatasetSnapshot`` or a selection of one): the one place the reader
    asks whether a dataset is bucketed. A bucketed one's sizes are its (selected) samples per bucket."""
    if not snapshot.is_bucketed:
        return OneShape(len(snapshot), (int(snapshot.shape[0]), int(snapshot.shape[1])))
    sizes = np.bincount(np.asarray(snapshot.shard_buckets, np.int64), weights=snapshot.counts,
                        minlength=len(snapshot.buckets))
    return Buckets(tuple((int(h), int(w)) for h, w in snapshot.buckets), tuple(int(n) for n in sizes))


def mix_refusal(first: str, first_layout: Layout, other: str, other_layout: Layout) -> str | None:
    """Why the datasets at ``first`` and ``other`` cannot be mixed (None: they can): a batch has one shape,
    and where batches name their bucket (``batch_defaults``) the id must name one shape in every dataset."""
    if first_layout.shapes == other_layout.shapes:
        return None
    if first_layout.batch_defaults or other_layout.batch_defaults:
        return (f"cannot mix {first} (buckets {list(first_layout.shapes)}) with {other} (buckets "
                f"{list(other_layout.shapes)}): a batch's bucket id names one shape in every dataset; preprocess "
                "both with the same bucket list")
    (h, w), (other_h, other_w) = first_layout.shapes[0], other_layout.shapes[0]
    return (f"cannot mix {first} (images {(h, w, 3)}) with {other} (images {(other_h, other_w, 3)}): a batch has "
            "one shape; preprocess both with the same height and width")
