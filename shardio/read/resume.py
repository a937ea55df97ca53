"""Where a run is in its epochs: the one owner of ``state_dict()`` (numpy and the standard library only).

The protocol (``ShardDataset.cursor`` is an ``EpochCursor``; loaders call it, nothing else keeps a count):

1. ``begin(...)`` once per pass over the data, by whoever creates the iterator the training loop consumes
   (``ShardDataset.begin_pass`` does it for ``iter(dataset)``, ``ShardLoader`` and ``DeviceLoader``). It
   picks the epoch: the one ``set_epoch`` pinned, else a loaded state's, else the one after the last pass
   (the first pass is epoch 0): each new iteration is the next epoch, with no user hook.
2. ``handed_out(epoch_pass, batches)`` wraps the pass's batches where they leave for that consumer: it
   counts each one (``hand_out``) as it yields it, so the count behind ``state_dict`` is batches *handed
   out*, not prefetched, and a resume repeats and skips nothing. Every loader goes through it.
3. ``state_dict()`` is a global position: the epoch, and the number of epoch-order samples every rank has
   consumed (``position``; ranks step in lockstep under DDP, so one rank's count stands for all). It
   does not depend on the world size or the number of workers, so ``load_state_dict`` may come from
   another world size: the next pass deals what is left of that epoch over the new ranks (elastic
   resume). It also pins the dataset ``generation`` the epoch was taken on, and names the ``dataset``
   itself: the identity of that generation's root (``shardio.format.spec``, "Identity"). A state whose epoch is
   finished resumes at the next epoch (unless ``set_epoch`` pins the finished one again); a state taken
   after ``set_epoch(e)`` and before the next iteration is the start of ``e``.

A bucketed dataset (``shardio.read.bucket_order``) keeps each bucket's order world-size-free, so its
state adds, per bucket, the samples consumed (``bucket_positions``: a prefix of each bucket's order), and
the pass they belong to (``bucket_start``: consumed per bucket when the pass began; ``bucket_round``: the
pass's rounds taken). ``position`` is then their sum (informative). At the same world size the next pass
is that pass after its rounds (the batches of an uninterrupted run); at another, what is left of each
bucket is cut into rounds of the new size and interleaved again, and ``batches_seen`` counts on from the
whole rounds of the new size the consumed samples make (as a single shape's does from ``position``), so
a state saved after any chain of world sizes loads at any world size. A single-shape dataset's state is
unchanged.

A state is refused by another dataset, with a message naming both identities: first against the
snapshot open now (where the two prove another dataset: ``proves_another_dataset``; a state named by a
config's hash may come from before this dataset drew its identity), so a state of another dataset is not
mistaken for a collected generation; then against the root of the state's own generation here, which
must be the state's exactly. A copy or a move of the directory keeps its roots,
so it resumes. A state without ``dataset`` (saved by a shardio before identities) is not checked for it:
the sample count of its generation must still agree.

Order settings the user left at their defaults (``defaulted``: window, block, order version) take a
loaded state's values, so a run resumes, and goes on, with the order it began with: a state saved before
order version 2 (no ``order_version``, windows of 8, blocks of 16) resumes exactly under version 1. A
setting passed explicitly must equal the state's.

``batches_seen`` (in the state and on the cursor) is kept for readers of older states: this rank's batch
number within the epoch, counting the batches before a resume at the resumed layout.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from shardio.format import FORMAT_VERSION
from shardio.format.root_fields import proves_another_dataset
from shardio.read.layout import Layout
from shardio.read.one_shape import OneShape
from shardio.read.order import Deal

__all__ = ["EpochCursor", "EpochPass"]

# Settings a state only fits when they are equal: they change the epoch order itself. A state without
# ``order_version`` was cut with version 1 (``shardio.read.order``), the only one there was.
ORDER_SETTINGS = ("seed", "shuffle", "shuffle_window", "shuffle_block", "order_version", "drop_last",
                  "batch_size")
_ABSENT_IS = {"order_version": 1}

T = TypeVar("T")


@dataclass(frozen=True)
class EpochPass:
    """One pass over (the rest of) an epoch on one rank: what its iterator yields, in order."""

    epoch: int
    start: int  # epoch position before which all ranks consumed everything (0: a fresh epoch)
    batches: Sequence[range]  # this rank's batches from ``start``, as epoch positions (``RankBatches``, a
    # bucketed dataset's ``BucketRankBatches``: computed on demand, so a pass pickles small to DataLoader workers)
    before: int  # batch number of this rank's first batch of the pass, minus one
    samples: int
    generation: int
    layout: Layout  # the generation's (``shardio.read.layout``): what the pass's place is counted in
    dataset: str = ""  # the identity of the generation's root (spec, "Identity")


@dataclass
class EpochCursor:
    """The epoch, the current pass and the batches handed out of it (see the module docstring). What differs
    between a single shape and buckets, it asks the pass's layout (``shardio.read.layout``)."""

    batch_size: int
    rank: int
    world_size: int
    drop_last: bool
    settings: dict[str, Any]  # the ORDER_SETTINGS values, checked against a loaded state
    defaulted: frozenset[str] = frozenset()  # settings the user left out: a loaded state's values win
    epoch: int = 0
    current: EpochPass | None = None
    handed: int = 0
    _pinned: bool = False  # set_epoch since the last pass
    _pending: dict[str, Any] | None = None  # a loaded state (with its generation's ``layout``), for the next pass
    _handover: EpochPass | None = None  # begun in the main process, for DataLoader workers' copies

    def deal(self) -> Deal:
        """How this rank's batches are dealt (the order's shuffle and seed: a loaded state's, once adopted)."""
        return Deal(self.batch_size, self.rank, self.world_size, self.drop_last,
                    shuffle=bool(self.settings["shuffle"]), seed=int(self.settings["seed"]))

    def set_epoch(self, epoch: int) -> None:
        """The next pass is ``epoch`` (later passes count on from it); a loaded state for that same epoch
        still resumes it (``set_epoch`` after ``load_state_dict``, as an epoch loop does)."""
        self.epoch, self._pinned = int(epoch), True
        if self._pending is not None and self._pending["epoch"] != self.epoch:
            self._pending = None

    def seek(self, epoch: int, batches: int, samples: int, generation: int, layout: Layout | None = None) -> None:
        """The next pass is ``epoch`` after this rank's first ``batches`` of it (which the ranks consumed
        in lockstep), as if a state taken there were loaded; ``batches=0`` is ``set_epoch(epoch)``. For a
        caller that places the dataset in its epochs itself (``shardio.read.mixing`` interleaves datasets).
        ``layout``: the dataset's (default: one shape of ``samples``)."""
        layout = layout or OneShape(samples)
        self.set_epoch(epoch)
        self._pending = None
        if batches:
            self._pending = {"epoch": self.epoch, "batches_seen": int(batches), "generation": generation,
                             "samples": samples, "layout": layout,
                             **layout.seek(self.deal(), self.epoch, int(batches))}

    def next_pass(self) -> tuple[int, int, int | None]:
        """(epoch, start position, generation or None) of the pass about to begin; no state changes."""
        pending = self._pending
        if pending is not None and (self._pinned or pending["layout"].has_left(self.deal(), pending)):
            return pending["epoch"], pending["position"], pending.get("generation")
        if pending is not None:  # the state's epoch was finished: an iteration now is the next one
            return pending["epoch"] + 1, 0, None
        if self._pinned or self.current is None:
            return self.epoch, 0, None
        return self.epoch + 1, 0, None

    def begin(self, samples: int, generation: int, dataset: str = "", layout: Layout | None = None) -> EpochPass:
        """Start the pass ``next_pass()`` named, on a dataset of ``samples`` at ``generation`` (whose root's
        identity is ``dataset``; ``layout``: its layout, default one shape of ``samples``)."""
        layout = layout or OneShape(samples)
        epoch, start, _ = self.next_pass()
        start, batches, before = layout.begin(self.deal(), epoch, start, self._pending)
        self.current = EpochPass(epoch, start, batches, before, samples, generation, layout, dataset)
        self.epoch, self.handed, self._pinned, self._pending = epoch, 0, False, None
        return self.current

    def hand_over(self, epoch_pass: EpochPass | None) -> None:
        """Make ``epoch_pass`` the one the next ``iter()`` of a copy of this cursor uses (DataLoader workers
        copy the dataset when the loader's iterator starts); ``None`` once they have their copies."""
        self._handover = epoch_pass

    def take_handover(self) -> EpochPass | None:
        handover, self._handover = self._handover, None
        return handover

    def hand_out(self, epoch_pass: EpochPass) -> None:
        """The consumer received one more batch of ``epoch_pass`` (an older pass's iterator is ignored)."""
        if epoch_pass is self.current:
            self.handed += 1

    def handed_out(self, epoch_pass: EpochPass, batches: Iterable[T]) -> Iterator[T]:
        """``batches`` (``epoch_pass``'s, in order), each counted as this yields it: when the caller's
        ``next()`` returns it. Wrap the layer closest to the training loop (or one that yields each batch
        the moment it gets it): what layers inside pulled ahead (prefetch threads, workers, a device copy
        of the next batch) is not counted until it comes out here, so a ``state_dict`` taken between
        batches names exactly what was received. Closed or dropped
        early, the count stays at what was yielded; an exhausted pass leaves it at the pass's end (the next
        ``begin`` is the next epoch); once another pass began, this one's batches count nothing."""
        for batch in batches:
            self.hand_out(epoch_pass)  # before the yield: the caller has it the moment it is counted
            yield batch

    @property
    def batches_seen(self) -> int:
        """This rank's batch number of the last batch handed out in the epoch (0: none yet)."""
        if self._pending is not None:
            return int(self._pending["batches_seen"])
        if self.current is None or self._pinned:  # set_epoch since the pass: the pinned epoch's start
            return 0
        return self.current.before + self.handed

    def position(self) -> int:
        if self._pending is not None:
            return int(self._pending["position"])
        if self.current is None or self._pinned:
            return 0
        current = self.current
        return current.layout.position(self.deal(), current.start, current.batches, self.handed)

    def _layout_state(self, layout: Layout) -> dict[str, Any]:
        """The state's keys of the layout (none for a single shape; ``layout``: the snapshot's open now)."""
        pending, current = self._pending, self.current
        if pending is not None:
            return pending["layout"].pending_state(pending)
        if current is None:
            return layout.start_state()  # before the first pass: the start of the epoch
        if self._pinned:
            return current.layout.start_state()
        return current.layout.pass_state(current.batches, self.handed)

    def state_dict(self, samples: int, generation: int, batches_seen: int | None = None,
                   dataset: str = "", layout: Layout | None = None) -> dict[str, Any]:
        """The state; ``batches_seen`` overrides the count handed out (this rank's batch number);
        ``samples``, ``generation``, ``dataset`` (its identity) and ``layout`` (default: one shape of
        ``samples``) describe the snapshot open now, named when no pass nor loaded state says otherwise."""
        layout = layout or OneShape(samples)
        current = self.current
        if batches_seen is not None and current is not None and self._pending is None:
            handed, self.handed = self.handed, max(0, int(batches_seen) - current.before)
            try:
                return self.state_dict(samples, generation, dataset=dataset, layout=layout)
            finally:
                self.handed = handed
        if self._pending is None and current is not None and not self._pinned:
            samples, generation, dataset = current.samples, current.generation, current.dataset or dataset
        elif self._pending is not None:
            samples = self._pending.get("samples", samples)
            generation = self._pending.get("generation", generation)
            dataset = self._pending.get("dataset") or dataset
        return {
            "format_version": FORMAT_VERSION,
            "epoch": self.epoch if self._pending is None else self._pending["epoch"],
            "position": self.position(),
            "batches_seen": self.batches_seen,
            "generation": generation,
            **({"dataset": dataset} if dataset else {}),
            "samples": samples,
            "rank": self.rank,
            "world_size": self.world_size,
            **self._layout_state(layout),
            **self.settings,
        }

    def load_state_dict(self, state: dict[str, Any], at: Any, identity: str = "",
                        where: str = "this dataset") -> None:
        """Resume where ``state`` was: the next pass finishes its epoch. ``at(generation)`` is the dataset's
        (sample count, identity, layout) at that generation (the state's own generation, when it has one;
        None: the snapshot open now); ``identity``: the open snapshot's; ``where`` names the dataset in
        errors."""
        adopted = {}
        for key in ORDER_SETTINGS:
            theirs = state.get(key, _ABSENT_IS.get(key, self.settings[key]))
            if theirs == self.settings[key]:
                continue
            if key not in self.defaulted:
                raise ValueError(
                    f"cannot resume: the state has {key}={theirs!r}, this dataset has "
                    f"{self.settings[key]!r}; resume with the same settings"
                )
            adopted[key] = theirs  # left at the default: the run goes on with the order it began with
        theirs = state.get("dataset")
        if theirs is not None and identity and proves_another_dataset(theirs, identity):
            raise ValueError(_foreign(state, identity, where))  # before its generation is looked for here
        samples, here, layout = at(state.get("generation"))
        if theirs is not None and theirs != here:
            raise ValueError(_foreign(state, here, where))
        if "samples" in state and state["samples"] != samples:
            raise ValueError(
                f"cannot resume: the state's epoch has {state['samples']} samples, this dataset "
                f"{samples}; resume on the snapshot the state was taken on (its generation)"
            )
        world_size = int(state.get("world_size", self.world_size))
        position, batches_seen, keys = layout.resume(state, int(state["batches_seen"]), self.batch_size,
                                                     world_size, self.drop_last, where)
        if not 0 <= position <= samples:
            raise ValueError(f"position={position} is outside the epoch's 0..{samples}")
        self.settings.update(adopted)
        self.epoch = int(state["epoch"])
        self._pinned = False
        self._pending = {"epoch": self.epoch, "position": position, "batches_seen": batches_seen,
                         "generation": state.get("generation"), "samples": samples, "dataset": here,
                         "world_size": world_size, "layout": layout, **keys}


def _foreign(state: dict[str, Any], identity: str, where: str) -> str:
    return (f"cannot resume: the state was taken on dataset {state['dataset']} (generation "
            f"{state.get('generation')}), and {where} is dataset {identity}: a state resumes only the dataset it "
            "was taken on (or a copy or move of its directory); load it into that dataset, or start this one "
            "without it")
