"""The access sequence a shard cache plans by (``shardio.read.cache.shard_cache``), written down a horizon at a time.

A pass's steps are a pure function of the order, so the whole pass could be listed up front; but that list grows
with the dataset (a step is up to a batch of entries: 1.9M entries, 3.6 s and 400 MB before the first batch at 3,000
shards of 1,000 samples on one rank, and ten times that at 30,000), while the cache only acts on what it can hold:
downloads ahead stop at its limit, and Belady's choice needs the next uses of the shards it holds. ``PlannedPass``
therefore keeps the steps from the slowest reader of the group (or the reader) to a horizon, grown as the reader and
the download threads reach it, and forgets the steps behind: its memory and each step's cost are bounded by the
horizon, not by the pass. The horizon reaches as far as the cache could hold (the distinct bytes of the planned
steps past the cache's budget, so downloads ahead and the group's keep set are cut by the budget, as over the whole
pass), and never more than ``AHEAD_ENTRIES`` entries ahead (a cache as large as the dataset). A shard not read within
the horizon counts as not read again: Belady lets it go first, which the whole pass's plan would also do unless the
horizon is shorter than the cache (then a few more shards may be fetched twice).

Indexes are absolute: sequence index ``i`` and batch ``b`` mean the same entry and step from the pass's start,
whatever was forgotten before them.
"""

from __future__ import annotations

import bisect
import hashlib
from array import array
from collections.abc import Callable, Sequence

__all__ = ["AHEAD_ENTRIES", "GROW_STEPS", "KeepSet", "PlannedPass"]

# At most this many entries (a step's distinct shards each) planned ahead of the reader: 16 bytes each, 4 MB. One
# rank's window of 256 shards of 1,000 samples is about 162,000 entries in batches of 256 (162 shards a batch); a
# node's step of 8 ranks reads nearly every shard of the window (about 32,000 entries a window).
AHEAD_ENTRIES = 1 << 18
# Steps planned at a time when the horizon grows (a few milliseconds at 8 ranks).
GROW_STEPS = 8
# The entries behind the slowest reader forgotten at once (so forgetting costs O(1) an entry, amortised).
FORGET_ENTRIES = 1 << 12


class PlannedPass:
    """The steps ``steps[base_batch:batches]`` of a pass (each a list of shard indices, in read order) as a
    sequence of unit keys (``key_of``), with each key's uses (absolute sequence indices) for Belady and the distinct
    bytes they hold (``size_of``); ``digest`` hashes every step planned, in order, for processes to compare."""

    def __init__(self, steps: Sequence[Sequence[int]], key_of: Callable[[int], str],
                 size_of: Callable[[str], int]) -> None:
        self.steps, self._key_of, self._size_of = steps, key_of, size_of
        self.base = 0  # the sequence index of ``_sequence[0]``
        self.base_batch = 0  # the batch ``_starts[0]`` starts
        self.live, self.live_batch = 0, 0  # where reading may still be (``forget``): nothing before is read again
        self._sequence: list[str] = []
        self._starts: list[int] = [0]  # where each batch from ``base_batch`` starts, and the end
        self.uses: dict[str, array[int]] = {}  # key -> its sequence indices planned, ascending
        self.window_bytes = 0  # the distinct keys' bytes from ``live`` to the end
        self.largest = 0  # the bytes of the largest step planned so far
        self._digest = hashlib.blake2b(digest_size=16)

    @property
    def batches(self) -> int:
        """How many batches (steps) are planned, from the pass's start."""
        return self.base_batch + len(self._starts) - 1

    @property
    def end(self) -> int:
        """The sequence index after the last entry planned."""
        return self._starts[-1]

    @property
    def complete(self) -> bool:
        return self.batches >= len(self.steps)

    @property
    def digest(self) -> str:
        return self._digest.hexdigest()

    def start(self, batch: int) -> int:
        """Where batch ``batch`` starts in the sequence (``batches``: the end); a batch planned and not forgotten."""
        return self._starts[batch - self.base_batch]

    def key(self, index: int) -> str:
        return self._sequence[index - self.base]

    def keys(self, start: int, stop: int) -> list[str]:
        return self._sequence[start - self.base : stop - self.base]

    def next_use(self, key: str, after: int) -> float:
        """The first sequence index from ``after`` where ``key`` is read within the horizon (else infinity)."""
        uses = self.uses.get(key)
        if uses is None:
            return float("inf")
        i = bisect.bisect_left(uses, after)
        return uses[i] if i < len(uses) else float("inf")

    def grow(self, count: int, limit: int) -> tuple[int, int, int] | None:
        """Plan up to ``count`` more steps; the first step that needs more than ``limit`` bytes on disk at once is
        not planned and returned as ``(bytes, shards, first shard)`` (planning stops there), else None."""
        for number in range(self.batches, min(self.batches + count, len(self.steps))):
            shards = list(self.steps[number])
            keys = [self._key_of(s) for s in shards]
            distinct = set(keys)
            need = sum(self._size_of(k) for k in distinct)
            if need > limit:
                return need, len(distinct), shards[0]
            self.largest = max(self.largest, need)
            index = self.end
            for i, key in enumerate(keys):
                if i and keys[i - 1] == key:  # a batch reads a run of one shard as one entry
                    continue
                uses = self.uses.get(key)
                if uses is None:
                    uses = self.uses[key] = array("q")
                if not uses or uses[-1] < self.live:  # new to what may still be read
                    self.window_bytes += self._size_of(key)
                uses.append(index)
                self._sequence.append(key)
                index += 1
            self._starts.append(index)
            self._digest.update("\n".join(keys).encode() + b"\n\n")
        return None

    def forget(self, before_batch: int) -> list[str]:
        """Nothing before ``before_batch`` is read again (a reader never looks back past the slowest): its keys read
        no later stop counting in ``window_bytes`` now, and the entries are dropped once ``FORGET_ENTRIES`` or more
        (so forgetting costs O(1) an entry, amortised); returns the keys dropped from ``uses``."""
        before_batch = min(max(before_batch, self.live_batch), self.batches)
        cut = self.start(before_batch)
        passed = self._sequence[self.live - self.base : cut - self.base]
        for key in set(passed):
            if self.live <= self.uses[key][-1] < cut:  # its last read is behind: it no longer counts
                self.window_bytes -= self._size_of(key)
        self.live, self.live_batch = cut, before_batch
        if cut - self.base < FORGET_ENTRIES:
            return []
        gone = set(self._sequence[: cut - self.base])
        del self._sequence[: cut - self.base]
        del self._starts[: before_batch - self.base_batch]
        self.base, self.base_batch = cut, before_batch
        dropped = []
        for key in gone:
            uses = self.uses[key]
            del uses[: bisect.bisect_left(uses, cut)]
            if not uses:
                del self.uses[key]
                dropped.append(key)
        return dropped

    def first_batch_from(self, index: int) -> int:
        """The first batch planned that starts at or after sequence index ``index`` (or ``batches``)."""
        return self.base_batch + bisect.bisect_left(self._starts, index, hi=len(self._starts) - 1)


class KeepSet:
    """The distinct keys a planned pass reads from a place on (``start``), in order, as many as a budget of bytes takes
    (a group's keep set, ``shardio.read.cache.cache_room``), kept up to date as the place and the horizon move: a key
    leaves when the place passes its last read before ``stop`` (where counting stopped), and counting goes on from
    ``stop``. O(1) an entry passed or counted, amortised, instead of the budget's entries at every step."""

    def __init__(self) -> None:
        self.keys: set[str] = set()
        self._of: tuple[PlannedPass, int] | None = None  # the pass and budget counted for
        self.start = self.stop = 0
        self._total = 0

    def update(self, planned: PlannedPass, start: int, budget: int, size_of: Callable[[str], int]) -> set[str]:
        """The keep set from sequence index ``start`` under ``budget``."""
        if self._of != (planned, budget) or not self.start <= start <= self.stop or self.start < planned.base:
            self._of, self.keys, self._total = (planned, budget), set(), 0  # counted afresh
            self.start = self.stop = start
        for key in set(planned.keys(self.start, start)):  # the entries passed
            if key in self.keys and planned.next_use(key, start) >= self.stop:
                self.keys.discard(key)
                self._total -= size_of(key)
        self.start = start
        index = self.stop
        while index < planned.end:
            chunk = planned.keys(index, min(index + 4096, planned.end))
            for key in chunk:
                if key not in self.keys:
                    size = size_of(key)
                    if self._total + size > budget:
                        self.stop = index
                        return self.keys
                    self.keys.add(key)
                    self._total += size
                index += 1
        self.stop = index
        return self.keys
