"""The layout of a single-shape dataset (numpy only): every sample H×W, one epoch order over all the shards.

``OneShape`` is one of the two ``shardio.read.layout.Layout``\\ s: the order is ``shardio.read.order``'s
(lazily, ``shardio.read.epoch_plan.EpochPlan``), the rank split ``rank_batches``, and a resume state is a
global position (``shardio.read.resume``): it carries no keys of its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from shardio.read.epoch_plan import EpochPlan
from shardio.read.order import (
    Deal,
    RankBatches,
    checked_batches_seen,
    consumed_position,
    epoch_runs,
    rank_batches,
)

__all__ = ["OneShape"]

Shape = tuple[int, int]


@dataclass(frozen=True)
class OneShape:
    """``samples`` samples of one ``shape`` (height, width); the shape is (0, 0) for an epoch cursor used on
    its own, which never asks it."""

    samples: int
    shape: Shape = (0, 0)

    # A batch carries no key of the layout's; a bucketed dataset's do (``Buckets.batch_defaults``).
    batch_defaults: ClassVar[dict[str, Any]] = {}
    # How ``drop_last`` with too few samples is explained: the whole epoch has no full round.
    where_full: ClassVar[str] = ""

    @property
    def shapes(self) -> tuple[Shape, ...]:
        return (self.shape,)

    @property
    def sizes(self) -> tuple[int, ...]:
        return (self.samples,)

    @property
    def turns(self) -> int:
        """Orders that take turns in an epoch, each reading its own window of shards: one."""
        return 1

    @property
    def largest(self) -> int:
        """Samples of the largest order a full round is cut from: all of them."""
        return self.samples

    # --- the order -----------------------------------------------------------------------------------

    def plan(self, snapshot: Any, **order: Any) -> EpochPlan:
        """The epoch's order over the snapshot's shards, window by window (``order``: ``shuffle``, ``seed``,
        ``epoch``, ``shuffle_window``, ``shuffle_block``, ``order_version``)."""
        return EpochPlan(snapshot.counts, **order)

    def runs(self, snapshot: Any, **order: Any) -> np.ndarray:
        """The whole epoch's runs, written down (tests and measurements)."""
        return epoch_runs(snapshot.counts, **order)

    def rank_batches(self, deal: Deal, epoch: int) -> RankBatches:
        """This rank's batches of a whole epoch (the epoch does not change them: the order does)."""
        return rank_batches(self.samples, deal.batch_size, deal.rank, deal.world_size, deal.drop_last)

    def batches_per_epoch(self, batch_size: int, world_size: int, drop_last: bool) -> int:
        """A rank's batches per epoch: the same on every rank."""
        return len(rank_batches(self.samples, batch_size, 0, world_size, drop_last))

    # --- a batch -------------------------------------------------------------------------------------

    def buffer_bytes(self, batch_size: int) -> int:
        """The least a batch buffer holds: no floor, every full batch has the one size."""
        return 0

    def batch_shape(self, snapshot: Any, shard: int) -> Shape:
        return self.shape

    def batch_fields(self, snapshot: Any, shard: int) -> dict[str, Any]:
        return {}

    # --- resume (``shardio.read.resume``): a global position is the whole place --------------------

    def seek(self, deal: Deal, epoch: int, batches: int) -> dict[str, Any]:
        return {"position": consumed_position(self.samples, deal.batch_size, deal.world_size, 0, batches)}

    def has_left(self, deal: Deal, pending: dict[str, Any]) -> bool:
        return bool(rank_batches(self.samples, deal.batch_size, 0, deal.world_size, deal.drop_last,
                                 pending["position"]))

    def begin(self, deal: Deal, epoch: int, start: int,
              pending: dict[str, Any] | None) -> tuple[int, RankBatches, int]:
        """(start position, this rank's batches, batch number before them) of a pass from ``start``."""
        start = min(start, self.samples)
        batches = rank_batches(self.samples, deal.batch_size, deal.rank, deal.world_size, deal.drop_last, start)
        return start, batches, start // deal.per_round

    def position(self, deal: Deal, start: int, batches: Any, handed: int) -> int:
        return consumed_position(self.samples, deal.batch_size, deal.world_size, start, handed)

    def start_state(self) -> dict[str, Any]:
        return {}

    def pass_state(self, batches: Any, handed: int) -> dict[str, Any]:
        return {}

    def pending_state(self, pending: dict[str, Any]) -> dict[str, Any]:
        return {}

    def resume(self, state: dict[str, Any], batches_seen: int, batch_size: int, world_size: int,
               drop_last: bool, where: str) -> tuple[int, int, dict[str, Any]]:
        """(position, batches_seen, the pending's keys) of ``state``, taken at ``world_size``."""
        if "bucket_positions" in state:
            raise ValueError(f"cannot resume: {where} is single-shape, the state is of a bucketed dataset; "
                             "resume the dataset the state was taken on")
        full = self.batches_per_epoch(batch_size, world_size, drop_last)
        batches_seen = checked_batches_seen(batches_seen, full)
        if "position" in state:
            position = int(state["position"])
        else:  # a state from before positions: batches_seen of a fresh epoch at the state's world size
            position = consumed_position(self.samples, batch_size, world_size, 0, batches_seen)
        return position, batches_seen, {}
