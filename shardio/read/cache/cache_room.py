"""How the shard cache (``shardio.read.cache.shard_cache.ShardCache``) makes room for a download. Alone: Belady's
policy, evicting the held shard read farthest ahead, and only one read later than the shard it makes room for. In a
group of processes sharing the directory (``shardio.read.cache.cache_group``): the group's keep set, the shards it
reads next from its slowest process on (``shardio.read.cache.group_positions``), which every process computes alike
and so lets go of the same files in the same order; a shard this process reads now that finds no room outside it is
made room for as alone."""

from __future__ import annotations

import threading
import time

from shardio.read.cache.cache_dir import CacheDir, CachedShard
from shardio.read.cache.cache_plan import KeepSet, PlannedPass
from shardio.read.cache.group_positions import GroupPositions

__all__ = ["CacheRoom"]

_ABSENT, _LOADING, _HELD, _DOOMED, _FAILED = "absent", "loading", "held", "doomed", "failed"

# How long a read past the group's slowest process waits for room in the directory while that process does not move
# (stopped reading mid-pass): then it goes ahead, over the limit, rather than hang.
HOLD_BACK_S = 10.0

# How long a count of the directory's bytes serves a group's leader (``CacheRoom._directory_room``) before it counts
# again (a tenth of it at the soonest when the count says it is full).
DIRECTORY_RECOUNT_S = 0.05


class CacheRoom:
    """What ``ShardCache`` makes room with: it gives the plan (sequence, uses, batch starts, place), the held states,
    the counts and the budget these use, and ``_set``, ``_drop``, ``_add_used``, ``_next_use``, ``_unit``."""

    _cond: threading.Condition
    _pass: PlannedPass
    _batch: int
    _position: int
    _behind: int
    _budget: int
    _used: int
    _in: dict[str, set[str]]
    _maps: dict[str, int]
    _positions: GroupPositions | None
    _kept: tuple[int, int]
    _keep_set: KeepSet
    _lead: bool
    _directory_count: tuple[float, int]
    _hold_after: int
    _slowest_seen: tuple[int, float]
    files: CacheDir
    limit: int
    stats: dict[str, int]
    dooms: int

    def _unit(self, key: str) -> CachedShard:
        raise NotImplementedError

    def _set(self, key: str, state: str) -> None:
        raise NotImplementedError

    def _drop(self, key: str) -> None:
        raise NotImplementedError

    def _add_used(self, delta: int) -> None:
        raise NotImplementedError

    def _next_use(self, key: str, after: int | None = None) -> float:
        raise NotImplementedError

    def _current(self) -> tuple[int, set[str]]:
        """Where the batch being read ends in the sequence, and its shards (never evicted for a download ahead)."""
        batch_end = self._pass.start(min(self._batch + 1, self._pass.batches))
        return batch_end, set(self._pass.keys(self._position, batch_end))

    def _keep(self) -> set[str] | None:
        """In a group (``positions``): what the group holds now, the distinct shards it reads next from its slowest
        process's batch on, as many as this process's budget takes. That is Belady's set at that place, and the same
        in every process of the group, so they let go of the same files (a file goes when its last holder lets it
        go: processes keeping different parts of the past would keep all of it). None alone."""
        if self._positions is None:
            return None
        start = self._pass.start(self._slowest_batch())
        if self._kept == (start, self._pass.end):
            return self._keep_set.keys
        keep = self._keep_set.update(self._pass, start, self._budget, lambda key: self._unit(key).size)
        self._kept = (start, self._pass.end)
        # Let go at once of what the group no longer keeps, not only when room is wanted: every process then holds
        # no more than the keep set (and the batch it reads), whatever it downloaded meanwhile.
        _, current = self._current()
        for victim in sorted(k for k in self._in[_HELD] if k not in keep and k not in current):
            self._evict(victim)
        return keep

    def _reserve(self, key: str, needed_at: float) -> CachedShard | None:
        unit = self._unit(key)
        batch_end, current = self._current()
        for_current = needed_at < batch_end
        keep = self._keep()
        if keep is not None:
            # In a group: ahead, only a shard of the group's keep set (the rest waits for the slowest to move on),
            # room made outside the keep set. A shard this process reads now that finds no room there is made room
            # for as alone, below.
            if not for_current and unit.key not in keep:
                return None
            fits = self._make_room(unit, keep, current)
            if not self._directory_room(unit, for_current, current):
                return None  # the group's files fill the directory: this download waits for the others
            if fits or not for_current:
                return self._take(unit)
        # For a download ahead, what a slower process of the group may still be about to adopt stays.
        slowest = self._position if for_current else self._pass.start(self._slowest_batch())
        # Doomed files free their bytes when their maps go: doom no more than the room still missing.
        freeing = self._freeing()
        while self._budget - self._used + freeing < unit.size:
            victims = []
            for k in self._in[_HELD]:
                if k in current and for_current:
                    continue
                use = self._next_use(k, batch_end if k in current else slowest)
                if use > needed_at:  # alone an unmapped file first (free at once); a group's processes alike
                    victims.append((use, k not in current, keep is not None or not self._maps.get(k), k))
            if not victims:
                return None
            use, free_now, _, victim = max(victims)
            if not free_now:
                return None  # the farthest is the shard in use: wait for the batch to end, then evict it
            if freeing and use != float("inf"):
                # Room is coming from doomed files' maps: wait for it rather than throw away a shard this pass
                # still reads (shards differ in size, so one doomed file may not make all the room).
                return None
            if self._maps.get(victim):
                freeing += self._unit(victim).size
            self._evict(victim)
        return self._take(unit)

    def _directory_room(self, unit: CachedShard, for_current: bool, current: set[str]) -> bool:
        """Whether a process of a group may download ``unit``: the directory, every process's files
        (``_directory_bytes``), has room for it. Each process holds no more than its budget, but they read the slowest
        step at different moments: at a window's end the others may still hold the old window while the leader keeps
        the next two, and a process that runs ahead of the slowest (its prefetch) reads past the keep set. Only the
        leader downloads ahead (the others adopt, or fetch what they read now), and a read past the steps the group
        needs to move on waits for room (``_held_back``), so this bounds the directory by the limit. For a batch the
        group needs now the leader makes room among its own files, the one read farthest ahead first, waits for its
        own doomed files' maps to go, and else goes ahead, as a follower does: such a read is never held back by the
        others."""
        if self.files.present(unit):
            return True  # adopting a file adds nothing
        held_back = for_current and self._held_back()
        if not self._lead and not held_back:
            return True  # a follower fetches only what it reads now
        counted = self._directory_bytes(unit.size, fresh=for_current)
        if counted + unit.size > self.limit:
            if not for_current or held_back:
                return False  # room comes as the slowest moves on and the group lets go of what it read
            for _, victim in sorted(((self._next_use(k), k) for k in self._in[_HELD] if k not in current),
                                    reverse=True):
                self._evict(victim)  # removed unless another process holds it too
                counted = self._directory_bytes(unit.size, fresh=True)
                if counted + unit.size <= self.limit:
                    break
            else:
                if self._in[_DOOMED]:
                    return False  # room comes as this process's maps of its doomed files go
        self._directory_count = (self._directory_count[0], counted + unit.size)  # this download, until a recount
        return True

    def _held_back(self) -> bool:
        """Whether the batch this process reads may wait for room in the directory: it lies more than ``_hold_after``
        steps past the slowest process reading the pass, which needs nothing from it to move on (ranks meet at the step
        each one reads; a rank's workers take its steps in turn, ``_hold_after`` apart), and that process moved within
        ``HOLD_BACK_S``. A process ahead of the group (its prefetch) then waits for the group instead of going past
        the limit."""
        if self._positions is None:
            return False
        slowest = self._positions.slowest_reading()
        if self._batch <= slowest + self._hold_after:
            return False
        now = time.monotonic()
        if slowest != self._slowest_seen[0]:
            self._slowest_seen = (slowest, now)
        return now - self._slowest_seen[1] < HOLD_BACK_S

    def _directory_bytes(self, size: int, fresh: bool) -> int:
        """The directory's bytes (``CacheDir.bytes_now``, downloads in progress at their whole size): counted again
        when ``fresh``, when the count is ``DIRECTORY_RECOUNT_S`` old, or when it leaves no room for ``size`` (a tenth
        of that apart at the soonest); else the last count with what this process reserved since."""
        now = time.monotonic()
        counted_at, counted = self._directory_count
        age = now - counted_at
        if fresh or age > DIRECTORY_RECOUNT_S or (counted + size > self.limit and age > DIRECTORY_RECOUNT_S / 10):
            loading = {key: self._unit(key).size for key in self._in[_LOADING]}
            counted_at, counted = now, self.files.bytes_now(loading, self._size_if_known)
            self._directory_count = (counted_at, counted)
        return counted

    def _size_if_known(self, key: str) -> int | None:
        raise NotImplementedError

    def _freeing(self) -> int:
        """Bytes of doomed files: free once their maps go."""
        return sum(self._unit(k).size for k in self._in[_DOOMED])

    def _take(self, unit: CachedShard) -> CachedShard | None:
        """Reserve ``unit``'s room for its download, unless it is still coming from doomed files' maps."""
        if self._budget - self._used < unit.size:
            return None
        self._set(unit.key, _LOADING)
        self._add_used(unit.size)
        return unit

    def _make_room(self, unit: CachedShard, keep: set[str], current: set[str]) -> bool:
        """In a group, let go of held shards outside the keep set (in key order, as every process of the group
        does) until ``unit`` fits, counting doomed files as free; whether it fits."""
        freeing = self._freeing()
        if self._budget - self._used + freeing >= unit.size:
            return True
        for victim in sorted(k for k in self._in[_HELD] if k not in keep and k not in current):
            if self._maps.get(victim):
                freeing += self._unit(victim).size
            self._evict(victim)
            if self._budget - self._used + freeing >= unit.size:
                return True
        return False

    def _evict(self, victim: str) -> None:
        """Let go of a held shard: doomed while this process maps it (removed when its last map goes, its room
        counted until then), else dropped."""
        self.stats["evictions"] += 1
        if self._maps.get(victim):
            self.dooms += 1
            self._set(victim, _DOOMED)
        else:
            self._drop(victim)

    def _shrink(self) -> None:
        """Give up held shards, the one read farthest ahead first, until this process holds no more than its budget
        (a follower beginning a pass still holds what it kept of the last one, which the leader holds too, or not)."""
        _, current = self._current()
        freeing = self._freeing()
        keep = self._keep() or set()
        victims = sorted(((k not in keep, self._next_use(k), k) for k in self._in[_HELD] if k not in current),
                         reverse=True)
        for _, _, victim in victims:
            if self._used - freeing <= self._budget:
                return
            if self._maps.get(victim):
                freeing += self._unit(victim).size
            self._evict(victim)

    def _slowest_batch(self) -> int:
        """The batch the slowest process of the group reads: from the group's positions, else ``behind`` back."""
        if self._positions is None:
            slowest = self._batch - self._behind
        else:
            slowest = min(self._batch, self._positions.slowest())
        return max(slowest, self._pass.base_batch)  # one further behind than the steps kept: from the first kept
