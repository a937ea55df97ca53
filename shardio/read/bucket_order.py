"""The epoch order of a bucketed dataset (numpy only): every batch one bucket, the same bucket on every rank.

A bucketed dataset (``mode: bucket``, format version 4) stores each bucket's samples in shards of that
bucket's shape. Its epoch keeps each bucket's order on its own, free of the world size:

- **Per-bucket order**: bucket ``b``'s shards (those whose ``shard_buckets`` is ``b``, in dataset order)
  get the single-shape order (``shardio.read.epoch_plan.EpochPlan``: same window, block and order version)
  from a seed derived from ``(seed, b)`` (``bucket_seed``), so buckets shuffle independently and each as
  well as a single-shape dataset does. It is a sequence of *bucket positions* ``0 .. n_b-1``.
- **Positions**: the epoch's positions are the buckets' positions laid end to end (bucket ``b`` at
  ``offsets[b] .. offsets[b+1]-1``), so a batch is still a range of positions, as for a single shape;
  ``BucketPlan.pieces`` maps a range inside one bucket to its ``(shard, start, stop)`` slices.
- **Rounds**: a step of the whole job is one round of ``world_size * batch_size`` samples of one bucket;
  rank ``r`` takes the ``r``-th batch of the round. Bucket ``b`` gives ``left_b // (W*B)`` full rounds and,
  without ``drop_last``, one short round of its rest, split over the ranks as ``RankBatches`` splits a
  single-shape tail (sizes differing by at most one; a rank that would get nothing repeats one sample of
  the bucket). With ``drop_last`` the rest of **each bucket** is dropped (up to ``W*B - 1`` samples a
  bucket, not a dataset).
- **Interleave**: which bucket each round takes (``interleave``): shuffled, a permutation of the multiset
  of the rounds' buckets from ``default_rng([seed, epoch, INTERLEAVE_TAG, *start])`` (``start``: each
  bucket's consumed samples where the pass began, zeros for a fresh epoch), so buckets come in proportion
  to their sizes and a run of one bucket is as short as chance makes it; unshuffled, a smooth
  proportional interleave (round ``j`` of bucket ``b`` at ``(j + 1/2) / rounds_b``). A uint16 per round
  and its number within its bucket (int32): O(rounds), never O(samples), computed by every rank and
  worker from a few ints.
- **Resume**: rounds take each bucket from its front, so where a run is, is each bucket's consumed count
  (a prefix of its order). A pass is fixed by ``start`` (consumed per bucket when it began) and ``skip``
  (its rounds already taken): a state at the same world size resumes the same pass after its rounds
  (bitwise the batches of an uninterrupted run); at another world size what is left of each bucket is cut
  into rounds of the new ``W*B`` and interleaved again (a new pass whose ``start`` is the consumed counts),
  so every remaining sample is seen once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, overload

import numpy as np

from shardio.read.epoch_plan import EpochPlan, Piece
from shardio.read.order import Deal, RankBatches, checked_batches_seen

__all__ = ["INTERLEAVE_TAG", "BucketPlan", "BucketRankBatches", "Buckets", "bucket_rounds", "bucket_seed",
           "consumed", "interleave", "rounds_consumed"]

# Entropy words that keep the bucket streams apart from a single-shape order's ``[seed, epoch, window]``.
INTERLEAVE_TAG = 0x6275636B  # "buck"
_BUCKET_SEED_TAG = 0x62736564  # "bsed"


def bucket_seed(seed: int, bucket: int) -> int:
    """The seed of bucket ``bucket``'s own order: a 63-bit draw from ``SeedSequence([seed, tag, bucket])``,
    so two buckets (and two seeds) give unrelated orders."""
    state = np.random.SeedSequence([int(seed), _BUCKET_SEED_TAG, int(bucket)]).generate_state(1, np.uint64)
    return int(state[0] >> np.uint64(1))


def bucket_rounds(left: np.ndarray, per_round: int, drop_last: bool) -> np.ndarray:
    """Rounds each bucket gives from ``left`` samples: the full ones, plus a short one for a rest unless
    ``drop_last``."""
    left = np.asarray(left, dtype=np.int64)
    full = left // per_round
    return full if drop_last else full + (left % per_round > 0)


def interleave(rounds: np.ndarray, *, shuffle: bool, seed: int, epoch: int, start: Sequence[int]) -> np.ndarray:
    """The bucket of each round (uint16 [sum(rounds)]): ``rounds[b]`` rounds of bucket ``b``, shuffled by
    ``default_rng([seed, epoch, INTERLEAVE_TAG, *start])``, or unshuffled in a smooth proportional order."""
    rounds = np.asarray(rounds, dtype=np.int64)
    buckets = np.repeat(np.arange(len(rounds), dtype=np.uint16), rounds)
    if shuffle:
        rng = np.random.default_rng([int(seed), int(epoch), INTERLEAVE_TAG, *(int(s) for s in start)])
        return buckets[rng.permutation(len(buckets))]
    first = np.repeat(np.cumsum(rounds) - rounds, rounds)
    place = (np.arange(len(buckets)) - first + 0.5) / np.repeat(np.maximum(rounds, 1), rounds)
    return buckets[np.argsort(place, kind="stable")]  # ties: the lower bucket first


def _occurrences(sequence: np.ndarray, buckets: int) -> np.ndarray:
    """For each round, how many rounds of its bucket come before it (int32: 4 bytes a round)."""
    order = np.argsort(sequence, kind="stable")
    counts = np.bincount(sequence, minlength=buckets)
    first = np.cumsum(counts) - counts
    occurrence = np.empty(len(sequence), np.int32)
    occurrence[order] = np.arange(len(sequence)) - np.repeat(first, counts)
    return occurrence


def consumed(sizes: Sequence[int], start: Sequence[int], sequence: np.ndarray, rounds_taken: int,
             per_round: int) -> list[int]:
    """Each bucket's consumed samples once ``rounds_taken`` rounds of ``sequence`` (from ``start``) are
    done: ``start`` plus the rounds' samples, a short round taking all that was left of its bucket."""
    taken = np.bincount(sequence[:rounds_taken], minlength=len(sizes)).astype(np.int64)
    left = np.asarray(sizes, np.int64) - np.asarray(start, np.int64)
    return (np.asarray(start, np.int64) + np.minimum(taken * per_round, left)).tolist()


class BucketRankBatches(Sequence[range]):
    """This rank's batches of a pass over a bucketed epoch, each a range of epoch positions inside one
    bucket (module docstring). Holds the round sequence (2 bytes a round) and each round's number within
    its bucket (4 bytes); a batch is computed on demand. Slices are views (a DataLoader worker's share)."""

    def __init__(self, sizes: Sequence[int], batch_size: int, rank: int, world_size: int, drop_last: bool, *,
                 shuffle: bool, seed: int, epoch: int, start: Sequence[int] | None = None, skip: int = 0,
                 indices: range | None = None) -> None:
        self.sizes = [int(n) for n in sizes]
        self.start = [0] * len(self.sizes) if start is None else [int(s) for s in start]
        if len(self.start) != len(self.sizes) or any(not 0 <= s <= n for s, n in zip(self.start, self.sizes)):
            raise ValueError(f"consumed samples per bucket {self.start} do not fit bucket sizes {self.sizes}")
        self.batch_size, self.rank, self.world_size, self.drop_last = batch_size, rank, world_size, drop_last
        self.shuffle, self.seed, self.epoch = shuffle, int(seed), int(epoch)
        self.per_round = batch_size * world_size
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)]).astype(np.int64)
        self._make_rounds()
        if not 0 <= skip <= len(self.sequence):
            raise ValueError(f"skip={skip} rounds is outside the pass's 0..{len(self.sequence)}")
        self.skip = int(skip)
        self._indices = range(self.skip, len(self.sequence)) if indices is None else indices

    def _make_rounds(self) -> None:
        """The round sequence and each round's number in its bucket, from the few ints above."""
        left = np.asarray(self.sizes, np.int64) - np.asarray(self.start, np.int64)
        self.rounds = bucket_rounds(left, self.per_round, self.drop_last)
        self.sequence = interleave(self.rounds, shuffle=self.shuffle, seed=self.seed, epoch=self.epoch,
                                   start=self.start)
        self._occurrence = _occurrences(self.sequence, len(self.sizes))
        self._tails: dict[int, RankBatches] = {}

    def __getstate__(self) -> dict[str, object]:
        # A pass goes to each DataLoader worker: a few ints, the worker makes the rounds again.
        return {k: v for k, v in self.__dict__.items() if k not in ("rounds", "sequence", "_occurrence", "_tails")}

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__dict__.update(state)
        self._make_rounds()

    def _bucket_batches(self, bucket: int) -> RankBatches:
        rank_batches = self._tails.get(bucket)
        if rank_batches is None:
            rank_batches = RankBatches(self.sizes[bucket], self.batch_size, self.rank, self.world_size,
                                       self.drop_last, self.start[bucket])
            self._tails[bucket] = rank_batches
        return rank_batches

    def bucket(self, index: int) -> int:
        """The bucket of this pass's batch ``index``."""
        return int(self.sequence[self._indices[index]])

    def _batch(self, round_number: int) -> range:
        bucket = int(self.sequence[round_number])
        local = self._bucket_batches(bucket)[int(self._occurrence[round_number])]
        offset = int(self.offsets[bucket])
        return range(local.start + offset, local.stop + offset)

    def __len__(self) -> int:
        return len(self._indices)

    @overload
    def __getitem__(self, index: int) -> range: ...
    @overload
    def __getitem__(self, index: slice) -> BucketRankBatches: ...
    def __getitem__(self, index: int | slice) -> range | BucketRankBatches:
        if isinstance(index, slice):
            view = object.__new__(BucketRankBatches)
            view.__dict__.update(self.__dict__)
            view._indices, view._tails = self._indices[index], {}
            return view
        return self._batch(self._indices[index])

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other))

    @property
    def steps(self) -> range:
        """The pass's step of each batch held (``shardio.read.order.DealtBatches``): rounds after ``skip``."""
        return range(self._indices.start - self.skip, self._indices.stop - self.skip, self._indices.step)

    def of_rank(self, rank: int) -> BucketRankBatches:
        """The whole pass as dealt to ``rank`` (``shardio.read.order.DealtBatches``): the same rounds."""
        other = object.__new__(BucketRankBatches)
        other.__dict__.update(self.__dict__)
        other.rank, other._tails = int(rank), {}
        other._indices = range(self.skip, len(self.sequence))
        return other

    def consumed_after(self, batches_each: int) -> list[int]:
        """Each bucket's consumed samples once every rank took ``batches_each`` batches of this pass
        (counted from the first batch of the pass, i.e. after ``skip``)."""
        return consumed(self.sizes, self.start, self.sequence, self.skip + int(batches_each), self.per_round)

    def __repr__(self) -> str:
        return f"BucketRankBatches({len(self)} batches: {list(self[:3])}{'...' if len(self) > 3 else ''})"


class BucketPlan:
    """One bucketed epoch's order: ``pieces(positions)`` for a range of epoch positions inside one bucket,
    as ``(shard, start, stop)`` slices of the dataset's shards. Each bucket's ``EpochPlan`` is made when a
    batch first reaches that bucket (O(its shards) plus its kept windows)."""

    def __init__(self, counts: np.ndarray, shard_buckets: np.ndarray, buckets: int, *, shuffle: bool,
                 seed: int, epoch: int, shuffle_window: int, shuffle_block: int, order_version: int) -> None:
        counts = np.asarray(counts, dtype=np.int64)
        shard_buckets = np.asarray(shard_buckets, dtype=np.int64)
        self.members = [np.flatnonzero(shard_buckets == b) for b in range(buckets)]
        self.sizes = [int(counts[m].sum()) for m in self.members]
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)]).astype(np.int64)
        self.samples = int(self.offsets[-1])
        self._counts = counts
        self._settings = {"shuffle": shuffle, "epoch": epoch, "shuffle_window": shuffle_window,
                          "shuffle_block": shuffle_block, "order_version": order_version}
        self.seed = int(seed)
        self._plans: dict[int, EpochPlan] = {}

    def plan(self, bucket: int) -> EpochPlan:
        """Bucket ``bucket``'s own order, over its shards (numbered within the bucket)."""
        made = self._plans.get(bucket)
        if made is None:
            made = EpochPlan(self._counts[self.members[bucket]], seed=bucket_seed(self.seed, bucket),
                             **self._settings)
            self._plans[bucket] = made
        return made

    def bucket_of(self, position: int) -> int:
        return int(np.searchsorted(self.offsets, position, side="right")) - 1

    def pieces(self, positions: range) -> list[Piece]:
        if not 0 <= positions.start <= positions.stop <= self.samples:
            raise ValueError(f"positions {positions} are outside the epoch's 0..{self.samples}")
        if positions.start == positions.stop:
            return []
        bucket = self.bucket_of(positions.start)
        offset = int(self.offsets[bucket])
        if positions.stop > self.offsets[bucket + 1]:
            raise ValueError(f"positions {positions} span buckets {bucket} and after: a batch is one bucket")
        members = self.members[bucket]
        local = self.plan(bucket).pieces(range(positions.start - offset, positions.stop - offset))
        return [(int(members[shard]), start, stop) for shard, start, stop in local]

    def runs(self) -> np.ndarray:
        """Every bucket's runs, bucket after bucket, in dataset shard ids (tests and measurements)."""
        parts = []
        for bucket, members in enumerate(self.members):
            if self.sizes[bucket]:
                runs = self.plan(bucket).runs().copy()
                runs[:, 0] = members[runs[:, 0]]
                parts.append(runs)
        return np.concatenate(parts) if parts else np.empty((0, 3), np.int64)


def rounds_consumed(positions: Sequence[int], per_round: int) -> int:
    """A bucketed pass's batch number before its first batch, at a layout of ``per_round`` samples a round:
    the whole rounds the consumed samples make, bucket by bucket. With the rounds left of each bucket it
    never exceeds the epoch's count at that layout (``floor(p / R) + ceil((n - p) / R) <= ceil(n / R)``),
    so a state saved after any chain of world sizes loads again."""
    return sum(int(p) // per_round for p in positions)


@dataclass(frozen=True)
class Buckets:
    """The layout of a bucketed dataset (``shardio.read.layout.Layout``): ``shapes`` (h, w) by bucket id and
    ``sizes``, the samples of each (of a selection: those it keeps). Its order is the module docstring's;
    its resume state adds the bucket keys (``shardio.read.resume``)."""

    shapes: tuple[tuple[int, int], ...]
    sizes: tuple[int, ...]

    # Every batch names its bucket; in a mix, a single-shape dataset's batches are bucket 0 of the list.
    batch_defaults: ClassVar[dict[str, Any]] = {"bucket": 0}
    where_full: ClassVar[str] = " in any bucket (drop_last drops each bucket's rest)"

    @property
    def samples(self) -> int:
        return sum(self.sizes)

    @property
    def turns(self) -> int:
        """Buckets that take turns in an epoch (those with samples), each reading its own window of shards."""
        return max(1, sum(1 for n in self.sizes if n))

    @property
    def largest(self) -> int:
        """Samples of the largest bucket: ``drop_last`` cuts full rounds from each bucket alone."""
        return max(self.sizes)

    # --- the order -----------------------------------------------------------------------------------

    def plan(self, snapshot: Any, **order: Any) -> BucketPlan:
        """Each bucket's own order, its positions laid end to end (``BucketPlan``)."""
        return BucketPlan(snapshot.counts, snapshot.shard_buckets, len(self.sizes), **order)

    def runs(self, snapshot: Any, **order: Any) -> np.ndarray:
        """The epoch positions' runs, bucket after bucket (batches take them round by round)."""
        return self.plan(snapshot, **order).runs()

    def rank_batches(self, deal: Deal, epoch: int, start: Sequence[int] | None = None,
                     skip: int = 0) -> BucketRankBatches:
        """This rank's batches of the epoch's pass from ``start`` (consumed per bucket), after ``skip`` rounds."""
        return BucketRankBatches(self.sizes, deal.batch_size, deal.rank, deal.world_size, deal.drop_last,
                                 shuffle=deal.shuffle, seed=deal.seed, epoch=epoch, start=start, skip=skip)

    def batches_per_epoch(self, batch_size: int, world_size: int, drop_last: bool) -> int:
        """Rounds of one bucket a step: the same count on every rank."""
        return int(bucket_rounds(self.sizes, batch_size * world_size, drop_last).sum())

    # --- a batch -------------------------------------------------------------------------------------

    def buffer_bytes(self, batch_size: int) -> int:
        """A batch of the largest bucket: one pool of buffers serves every bucket, no step allocates once
        it is full."""
        return batch_size * max(h * w for h, w in self.shapes) * 3

    def batch_shape(self, snapshot: Any, shard: int) -> tuple[int, int]:
        """A batch is one bucket: its first shard's shape."""
        return snapshot.shard_shape(shard)

    def batch_fields(self, snapshot: Any, shard: int) -> dict[str, Any]:
        return {"bucket": int(snapshot.shard_buckets[shard])}

    # --- resume (``shardio.read.resume``): consumed samples per bucket ------------------------------

    def seek(self, deal: Deal, epoch: int, batches: int) -> dict[str, Any]:
        positions = self.rank_batches(deal, epoch).consumed_after(int(batches))
        return {"position": sum(positions), "bucket_positions": positions, "bucket_start": [0] * len(self.sizes),
                "bucket_round": int(batches), "world_size": deal.world_size}

    def has_left(self, deal: Deal, pending: dict[str, Any]) -> bool:
        left = [n - p for n, p in zip(self.sizes, pending["bucket_positions"])]
        return bool(bucket_rounds(left, deal.per_round, deal.drop_last).sum())

    def begin(self, deal: Deal, epoch: int, start: int,
              pending: dict[str, Any] | None) -> tuple[int, BucketRankBatches, int]:
        """A pass: a pending state's own pass after its rounds (same world size), else its rest cut into
        rounds again, else a fresh epoch. (start position, this rank's batches, batch number before them)."""
        resumes = (pending is not None and pending["epoch"] == epoch and "bucket_positions" in pending
                   and tuple(pending["layout"].sizes) == self.sizes)
        if not resumes:
            return 0, self.rank_batches(deal, epoch), 0
        assert pending is not None
        positions, before = list(pending["bucket_positions"]), int(pending["batches_seen"])
        batches: BucketRankBatches | None = None
        if pending.get("bucket_round") is not None and pending.get("world_size") == deal.world_size:
            try:
                same = self.rank_batches(deal, epoch, pending["bucket_start"], int(pending["bucket_round"]))
            except ValueError:  # rounds past that pass's: not its state; what is left is still exact
                same = None
            if same is not None and same.consumed_after(0) == positions:  # the state's pass, after its rounds
                batches = same
        if batches is None:  # another world size: what is left of each bucket, in rounds of this one
            batches = self.rank_batches(deal, epoch, positions)
            before = rounds_consumed(positions, deal.per_round)
        return sum(positions), batches, before

    def position(self, deal: Deal, start: int, batches: BucketRankBatches, handed: int) -> int:
        return sum(batches.consumed_after(handed))

    def start_state(self) -> dict[str, Any]:
        zeros = [0] * len(self.sizes)  # the start of the epoch
        return {"bucket_positions": zeros, "bucket_start": zeros, "bucket_round": 0}

    def pass_state(self, batches: BucketRankBatches, handed: int) -> dict[str, Any]:
        return {"bucket_positions": batches.consumed_after(handed), "bucket_start": list(batches.start),
                "bucket_round": batches.skip + handed}

    def pending_state(self, pending: dict[str, Any]) -> dict[str, Any]:
        return {"bucket_positions": list(pending["bucket_positions"]), "bucket_start": list(pending["bucket_start"]),
                "bucket_round": pending.get("bucket_round")}

    def resume(self, state: dict[str, Any], batches_seen: int, batch_size: int, world_size: int,
               drop_last: bool, where: str) -> tuple[int, int, dict[str, Any]]:
        """(position, batches_seen, the pending's bucket keys) of ``state``, taken at ``world_size``; its
        bucket keys checked against these buckets (of the state's generation here)."""
        if "bucket_positions" not in state:
            raise ValueError(f"cannot resume: {where} is bucketed, the state is of a single-shape dataset; "
                             "resume the dataset the state was taken on")
        positions = [int(p) for p in state["bucket_positions"]]
        start = [int(p) for p in state.get("bucket_start", positions)]
        for name, values in (("bucket_positions", positions), ("bucket_start", start)):
            if len(values) != len(self.sizes) or any(not 0 <= p <= n for p, n in zip(values, self.sizes)):
                raise ValueError(f"cannot resume: the state's {name} {values} do not fit {where}'s buckets of "
                                 f"{list(self.sizes)} samples")
        round_taken = state.get("bucket_round")
        keys = {"bucket_positions": positions, "bucket_start": start,
                "bucket_round": None if round_taken is None else int(round_taken)}
        full = self.batches_per_epoch(batch_size, world_size, drop_last)
        if batches_seen > full:
            # A bucketed state's place is its ``bucket_positions`` (checked above); ``batches_seen`` only
            # numbers this rank's batches. One past the epoch's count was numbered at an earlier layout
            # (the world size before a resume): numbered again at the state's own layout.
            batches_seen = rounds_consumed(positions, batch_size * world_size)
        return sum(positions), checked_batches_seen(batches_seen, full), keys
