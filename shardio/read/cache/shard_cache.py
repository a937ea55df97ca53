"""The reader's local cache of remote shards: downloaded ahead in the order they will be read, bounded
in bytes, evicting the shard needed farthest in the future (Belady's optimal policy).

Why this works: the epoch order is a pure function of ``(seed, epoch, rank)``, so at the start of a pass
the reader hands the cache its exact *access sequence* (``plan``: the shards of every batch this process will
assemble, in order, as a sequence computed when asked), which the cache writes down a horizon ahead
(``shardio.read.cache.cache_plan``: as far as it could hold, a bounded number of entries). The cache then knows,
at every moment, when each shard it could hold is next needed, which no LRU cache of a streaming loader can know.

- **Ahead of need, in order.** ``threads`` download threads take the next shard of the sequence that is
  not on disk, as long as room can be made for it; the reader waits only for a shard that is late.
- **Bounded.** Bytes held = finished files + downloads in flight (reserved before they start) + files
  evicted while still memory-mapped (on Linux an unlinked file that is mapped keeps its blocks; such a
  file is *doomed*: removed when the last map of it goes, counted until then, rescued if needed again).
  Held bytes never exceed ``limit``; ``stats["peak_bytes"]`` records the most ever held.
- **Belady.** To make room for shard ``u`` (next needed at sequence index ``i``), evict the held shard
  whose next use is farthest, and only one needed later than ``i`` (else ``u`` waits its turn).
- **Checked, shared, warm** (``shardio.read.cache.cache_dir``): files are content addressed and appear only whole
  and checked (size, header, checksum); processes sharing the directory download a shard once and never
  remove one another holds; a file already there is used at once. Failures are retried ``attempts``
  times; then every ``pixels``/``output_arrays``/``meta_bytes`` call for that shard raises ``ShardError``
  naming the URL (a waiting reader is woken, never left hanging). ``plan`` first trims the directory to
  ``limit``: files no process holds, those this pass does not need first, then those needed last.
- **A unit is all of a shard's files**: its ``.npy``, its ``.jsonl`` and its model outputs' files (spec,
  "Model outputs"), downloaded, counted, held and evicted together; a map of any of them holds the unit.

The limit is per cache (one per process reading: a rank, or a DataLoader worker). The processes sharing a
directory plan one sequence, the node's (``shardio.read.cache.cache_group``), so they hold the same files: together
one limit (the one that downloads ahead counts the directory's files first, ``CacheRoom._directory_room``).
Pickling a cache gives a new, empty one (a worker plans its pass itself).
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from shardio.read.cache.cache_dir import CacheDir, CachedShard, Downloader
from shardio.read.cache import cache_plan
from shardio.read.cache.cache_plan import KeepSet, PlannedPass
from shardio.read.cache.cache_room import _ABSENT, _DOOMED, _FAILED, _HELD, _LOADING, CacheRoom
from shardio.read.cache.cached_views import CachedViews
from shardio.read.cache.group_positions import GroupPositions, prune
from shardio.read.cache.cache_units import ShardUnits, download_threads, largest_two, unit_algorithms, unit_sizes
from shardio.store.checksum import require
from shardio.errors import ShardError

__all__ = ["ShardCache"]

# A reader stuck this long on bytes held only by maps (batches the program keeps alive) raises instead of
# hanging a DDP job: the limit cannot hold what the program keeps mapped.
STUCK_TIMEOUT_S = 120.0


# Every cache of this process, so that a forked child resets them (``ShardCache._after_fork``).
_LIVE: weakref.WeakSet[ShardCache] = weakref.WeakSet()


def _reset_after_fork() -> None:
    for cache in list(_LIVE):
        cache._after_fork()


os.register_at_fork(after_in_child=_reset_after_fork)


class ShardCache(CacheRoom, CachedViews):
    """Shards of one snapshot (``units[i]`` for shard index ``i``) cached in ``cache_dir``, at most
    ``limit`` bytes; see the module docstring. ``plan`` a pass, ``advance`` as batches start, ``pixels``,
    ``output_arrays`` and ``meta_bytes`` to read; ``stats`` for counters; ``close`` to stop the threads.

    ``units`` is a list, or a ``ShardUnits`` over a ``ShardTable``: then opening costs column operations
    and no unit, a shard's unit is made when a plan or a read first names it (``unit``), and per-shard
    state exists only for the shards a pass touches (O(shards touched), not O(shards))."""

    def __init__(self, units: Sequence[CachedShard], store: Downloader | None, cache_dir: str, limit: int, *,
                 shape: tuple[int, int, int], threads: int | None = None, attempts: int = 3,
                 buckets: Sequence[tuple[int, int]] | None = None) -> None:
        self.units: Sequence[CachedShard] = units if isinstance(units, ShardUnits) else list(units)
        self.store, self.cache_dir, self.limit = store, cache_dir, int(limit)
        # ``buckets``: a bucketed dataset's (h, w) by bucket id, each unit mapped at its own (None: ``shape``)
        self.shape, self.attempts, self.buckets = shape, attempts, buckets
        sizes = unit_sizes(self.units)
        self.dataset_bytes = int(sizes.sum())  # every unit's bytes: a limit of at least this holds them all
        self.threads = download_threads(self.dataset_bytes // max(1, len(sizes))) if threads is None else threads
        self.largest_sizes = largest_two(sizes)  # the largest unit sizes, largest first
        self._check_limit()
        for algorithm in sorted(unit_algorithms(self.units)):
            require(algorithm)  # every download is checked: a missing xxhash fails here, not in a thread
        self.on_wait: Callable[[], None] | None = None  # called while the reader waits (drop idle maps)
        self._setup()

    def _check_limit(self) -> None:
        largest = self.largest_sizes
        if sum(largest) > self.limit:
            raise ValueError(f"cache_limit {self.limit} bytes cannot hold the two largest shards "
                             f"({sum(largest)} bytes: the one in use and the next; shards of "
                             f"{self.units[0].npy_url}'s dataset); raise cache_limit")

    def _setup(self) -> None:
        self._stop = threading.Event()
        self.files = CacheDir(self.cache_dir, self.shape, self._store, self._count, self._stop, self.attempts,
                              self.buckets)
        lock = threading.RLock()
        self._cond = threading.Condition(lock)  # readers wait on it for a download's end
        # Download threads wait on this one, each woken alone: one with a job wakes the next (``_work``), so an
        # event wakes as many as there is work for, not every thread (32 for small shards) to find none.
        self._jobs = threading.Condition(lock)
        self._units: dict[int, CachedShard] = {}  # shard index -> unit, for the shards used (``unit``)
        self._by_key: dict[str, CachedShard] = {}
        self._state: dict[str, str] = {}  # key -> state; a key not here is absent
        # the keys in each state but absent (planning touches only these)
        self._in: dict[str, set[str]] = {state: set() for state in (_LOADING, _HELD, _DOOMED, _FAILED)}
        self._errors: dict[str, str] = {}
        self._locks: dict[str, int] = {}  # key -> fd holding LOCK_SH while held
        self._maps: dict[str, int] = {}  # live memory maps per key
        self._demanded: list[str] = []  # wanted by the reader now (first in line)
        self._batch = 0
        self._behind = 0  # batches the slowest process planning the same sequence may be behind (``plan``)
        self._positions: GroupPositions | None = None  # where the group's processes are (``plan``)
        self._hold_after, self._slowest_seen = 1, (-1, 0.0)  # when a read waits for the group (``_held_back``)
        self._keep_set = KeepSet()  # the group's keep set, counted as the group and the horizon move
        self._kept = (-1, -1)  # (start, end) of the plan where the group's keep set last let go of files
        self._budget = self.limit  # what this process may hold: the limit, or a follower's two batches (``plan``)
        self._lead = True  # whether this process downloads ahead (a group's followers adopt: ``plan``)
        self._directory_count = (float("-inf"), 0)  # (when, bytes): the directory's files, for a group's leader
        self._released: deque[str] = deque()  # maps gone (finalizers only append: any thread, any time)
        self._used = 0
        self._pass = PlannedPass([], str, len)  # the planned steps, a horizon ahead (``plan``)
        self._refused: str | None = None  # why a step of this pass cannot be read (found as the plan grows)
        self._position = 0
        self._scan = 0
        self._workers: list[threading.Thread] = []
        self._forked = False
        _LIVE.add(self)
        self.dooms = 0  # how many times a mapped file was marked for eviction (readers drop their maps)
        self.stats = {"downloads": 0, "bytes_downloaded": 0, "adopted": 0, "hits": 0, "misses": 0,
                      "evictions": 0, "retries": 0, "peak_bytes": 0, "held_bytes": 0}

    def _after_fork(self) -> None:
        """In a forked child (a DataLoader worker): start afresh. The parent's threads are not here, its
        lock may have been held at the fork, and its flocks belong to the parent's open files."""
        for fd in self._locks.values():
            try:
                os.close(fd)  # our copy only: the parent's hold stays
            except OSError:
                pass
        self._setup()
        self._forked = True

    def __getstate__(self) -> dict[str, Any]:
        keep = ("units", "store", "cache_dir", "limit", "dataset_bytes", "largest_sizes",
                "shape", "threads", "attempts", "buckets")
        return {name: self.__dict__[name] for name in keep}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.on_wait = None
        self._setup()

    # --- the plan ---------------------------------------------------------------------------------

    def plan(self, batches: Sequence[Sequence[int]], behind: int = 0, lead: bool = True,
             positions: GroupPositions | None = None, hold_after: int = 1) -> None:
        """This pass's access sequence: for each batch (a step: the batches of every rank sharing the directory),
        the shard index of each of its pieces, in the order they are read (``advance(b)`` says the reader starts
        batch ``b``); a sequence whose steps are computed when asked, planned a horizon ahead (``cache_plan``).
        Refuses (``ShardError``, here or in ``advance`` as the plan reaches it) a limit that cannot hold the shards of
        one batch (all mapped while it is assembled). ``behind``: how many batches behind this process the slowest
        one planning the same sequence may be; what they read is not evicted for a download ahead (that one might
        not hold it yet), only for the batch this process reads now. ``lead=False``: another process of the group
        downloads ahead with the whole limit, while the directory has room; this one adopts ahead only files already
        there (downloading only what it reads now) and holds no more than two of its largest batches (the one read
        and the next), so the directory holds one limit however many processes share it. ``positions``: where
        the group's processes are (this one writes its batch there as it advances); then the slowest of them, not
        ``behind``, bounds what a download ahead may evict, and a batch more than ``hold_after`` steps past the
        slowest waits for room in the directory rather than pass the limit (``CacheRoom._held_back``)."""
        if self._forked and self.store is None:
            raise ShardError(
                f"{self.unit(0).npy_url}: an object-storage dataset cannot be read in a process started by "
                "fork() (a DataLoader worker's default on Linux): the S3 client's runtime (obstore, tokio) "
                "does not survive fork. Use num_workers=0 (the fast path: DeviceLoader prefetches on a thread), "
                "shardio.ShardLoader (its workers are spawned), or DataLoader(..., "
                "multiprocessing_context='spawn')")
        with self._cond:
            self._pass = PlannedPass(batches, lambda shard: self.unit(shard).key, lambda key: self._unit(key).size)
            self._refused = None
            self._batch, self._behind, self._positions = 0, behind, positions
            self._hold_after, self._slowest_seen = hold_after, (-1, 0.0)
            self._kept = (-1, -1)
            self._lead = lead
            self._budget = self.limit
            self._position = self._scan = 0
            for key in list(self._in[_FAILED]):  # a new pass tries again
                self._set(key, _ABSENT)
            for _ in range(2):  # the first steps now (a step too large for the limit refused here); the rest as read
                self._grow()
            self._check_refused()
            self._forget()
            self._shrink()
            self._trim()
            self._cond.notify_all()
            self._jobs.notify()
        self._start_threads()

    @property
    def plan_digest(self) -> str:
        """A hash of every step planned so far in this pass, in order: the processes of a group plan the same."""
        with self._cond:
            return self._pass.digest

    def advance(self, batch: int) -> None:
        """The reader starts batch ``batch`` of the plan."""
        if self._positions is not None:
            self._positions.at(batch)
        with self._cond:
            while self._pass.batches < min(batch + 2, len(self._pass.steps)) and self._refused is None:
                self._grow(needed=True)  # this batch and the next are planned before they are read
            self._check_refused()
            self._batch = batch
            self._position = self._pass.start(batch)
            self._scan = max(self._scan, self._position)
            self._grow()
            behind = max(self._pass.first_batch_from(self._position - cache_plan.AHEAD_ENTRIES), self._slowest_batch())
            if self._pass.forget(min(batch, behind)):
                self._forget()
            if self._used > self._budget:
                self._shrink()
            self._keep()  # in a group: what it no longer keeps is let go
            self._jobs.notify()
        self._start_threads()

    def _grow(self, needed: bool = False) -> None:
        """Plan ``GROW_STEPS`` more steps if the horizon wants them (under the lock; ``cache_plan``): the batch read
        and the next (or ``needed``), then as far as the budget could hold, at most ``AHEAD_ENTRIES`` ahead."""
        planned = self._pass
        if planned.complete or self._refused is not None:
            return
        if not needed and planned.batches >= self._batch + 2 and (
                planned.end - self._position >= cache_plan.AHEAD_ENTRIES
                or planned.window_bytes >= self._budget + planned.largest):
            return
        refused = planned.grow(cache_plan.GROW_STEPS, self.limit)
        if refused is not None:
            need, count, first = refused
            self._refused = (
                f"{self.unit(first).npy_url}: a step of this pass (a batch on each rank sharing the cache "
                f"directory) needs {count} shards ({need} bytes) on disk at once, over cache_limit {self.limit}; "
                "raise cache_limit or lower shuffle_window")
        if not self._lead:  # a follower holds two of its largest steps (the one read and the next)
            self._budget = min(self.limit, 2 * max(planned.largest, sum(self.largest_sizes)))

    def _check_refused(self) -> None:
        if self._refused is not None:
            raise ShardError(self._refused)

    def unit(self, shard: int) -> CachedShard:
        """Shard ``shard``'s unit: made on first use, kept while a pass needs it or the cache holds it."""
        unit = self._units.get(shard)
        if unit is None:
            with self._cond:
                unit = self._units.get(shard)
                if unit is None:
                    unit = self._units[shard] = self.units[shard]
                    self._by_key.setdefault(unit.key, unit)
        return unit

    def _forget(self) -> None:
        """Drop the units of shards neither the planned steps nor the cache needs (under the lock): what is kept
        stays O(shards of the horizon) however many steps and passes went before."""
        needed = self._pass.uses.keys() | self._state.keys() | set(self._demanded)
        self._units = {shard: unit for shard, unit in self._units.items() if unit.key in needed}
        self._by_key = {key: unit for key, unit in self._by_key.items() if key in needed}

    def _acquire(self, unit: CachedShard) -> None:
        waited, stuck_since = False, None
        with self._cond:
            self._by_key.setdefault(unit.key, unit)  # if a new plan forgot it since ``unit``
            while True:
                self._collect()
                state = self._state.get(unit.key, _ABSENT)
                if state == _DOOMED:  # needed again before its maps went: keep it
                    self._set(unit.key, _HELD)
                    state = _HELD
                if state == _HELD:
                    self.stats["misses" if waited else "hits"] += 1
                    return
                if state == _FAILED:
                    raise ShardError(self._errors[unit.key])
                if state == _ABSENT and unit.key not in self._demanded:
                    self._demanded.append(unit.key)  # first in line (also one read outside the plan)
                waited = True
                self._start_threads()
                stuck = not self._in[_LOADING]
                # Files evicted while this reader still maps them free their room only when the maps go: let
                # them go now, not only when nothing is loading (a download waiting for that room would wait
                # for this reader, which waits for a download: one download at a time).
                if (stuck or self._in[_DOOMED]) and self.on_wait is not None:
                    self.on_wait()
                    self._collect()
                stuck_since = (stuck_since or time.monotonic()) if stuck else None
                if stuck_since is not None and time.monotonic() - stuck_since > STUCK_TIMEOUT_S:
                    raise ShardError(
                        f"{unit.npy_url}: waited {STUCK_TIMEOUT_S:.0f} s for room in the cache "
                        f"({self.cache_dir}, cache_limit {self.limit}): {self._used} bytes are held by shards "
                        "still memory-mapped by batches the program keeps; raise cache_limit or release old "
                        "batches")
                self._jobs.notify()
                self._cond.wait(0.05)

    # --- planning (under the lock) ----------------------------------------------------------------

    def doomed(self) -> set[str]:
        """Keys of files waiting for their maps to go before they are removed."""
        with self._cond:
            return set(self._in[_DOOMED])

    def read_no_more(self, keys: Iterable[str]) -> set[str]:
        """Those of ``keys`` the planned pass reads no more from the batch begun last (``advance``): a reader
        that lets go of their maps now leaves their room free to take at once, instead of doomed until it next
        opens a shard (after a whole JPEG batch's decode, say: the next window's downloads waited for it)."""
        with self._cond:
            return {key for key in keys if self._next_use(key) == float("inf")}

    def maps_dropped(self) -> None:
        """A reader dropped maps (of doomed files, or of shards the pass reads no more): a doomed file's room is
        counted free at once, and the download threads waiting for room are woken (a map's finalizer only notes
        its end; it may run anywhere, so it takes no lock)."""
        with self._cond:
            self._collect()
            self._jobs.notify()

    def _set(self, key: str, state: str) -> None:
        old = self._state.pop(key, _ABSENT)
        if old != _ABSENT:
            self._in[old].discard(key)
        if state != _ABSENT:
            self._state[key] = state
            self._in[state].add(key)

    def _unit(self, key: str) -> CachedShard:
        return self._by_key[key]

    def _size_if_known(self, key: str) -> int | None:
        unit = self._by_key.get(key)
        return None if unit is None else unit.size

    def _next_use(self, key: str, after: int | None = None) -> float:
        """Where ``key`` is next read, from ``after`` (default: this process's place)."""
        return self._pass.next_use(key, self._position if after is None else after)

    def _collect(self) -> None:
        """Account for maps that went away; remove doomed files nothing maps any more."""
        while self._released:
            key = self._released.popleft()
            self._maps[key] -= 1
        for key in [k for k in self._in[_DOOMED] if not self._maps.get(k)]:
            self._drop(key)

    def _next_job(self) -> CachedShard | None:
        """The next shard to download, with room reserved for it, or None (nothing to do yet)."""
        self._collect()
        if self._stop.is_set():
            return None
        self._demanded = [k for k in self._demanded if k not in self._state]
        if self._demanded:
            return self._reserve(self._demanded[0], float(self._position))
        while True:
            if self._scan >= self._pass.end:
                end = self._pass.end
                self._grow()  # the horizon moves as the downloads reach it
                if self._pass.end == end:
                    return None
            key = self._pass.key(self._scan)
            state = self._state.get(key, _ABSENT)
            if state == _ABSENT:
                if not self._lead and not self.files.present(self._unit(key)):
                    return None  # a follower adopts ahead what the leader fetched; fetches only what it reads now
                return self._reserve(key, float(self._scan))
            if state == _DOOMED:
                self._set(key, _HELD)  # needed again: keep it
            self._scan += 1

    def _add_used(self, delta: int) -> None:
        self._used += delta
        self.stats["held_bytes"] = self._used
        self.stats["peak_bytes"] = max(self.stats["peak_bytes"], self._used)

    def _drop(self, key: str) -> None:
        """Give up a held file: removed unless another process holds it too."""
        unit = self._unit(key)
        fd = self._locks.pop(key, None)
        if fd is not None:
            self.files.release(unit, fd)
        self._set(key, _ABSENT)
        self._add_used(-unit.size)
        if self._scan > self._position and key in self._pass.uses:
            self._scan = self._position  # it may be needed again in this pass

    def _trim(self) -> None:
        """Bring the directory under the limit: remove files no process holds, first those this pass does
        not need, then those it needs last; and killed downloads' temp files no process is writing, and groups'
        positions files a day old."""
        prune(self.cache_dir)
        sizes, temps = self.files.usage()
        for key in temps:
            if self._state.get(key) != _LOADING:
                self.files.remove_dead_temps(key)  # kept while a download holds the lock
        total = sum(sizes.values())
        unheld = [k for k in sizes if self._state.get(k) in (None, _ABSENT, _FAILED)]
        unheld.sort(key=lambda k: -self._next_use(k))  # not needed (inf) first, then needed last
        for key in unheld:
            if total <= self.limit:
                break
            if self.files.remove_unheld(key):
                total -= sizes[key]

    # --- download threads -------------------------------------------------------------------------

    def _start_threads(self) -> None:
        self._workers = [t for t in self._workers if t.is_alive()]
        while len(self._workers) < self.threads and not self._stop.is_set():
            thread = threading.Thread(target=self._work, name="shardio-cache", daemon=True)
            self._workers.append(thread)
            thread.start()

    def _work(self) -> None:
        idle_since = time.monotonic()
        while not self._stop.is_set():
            with self._cond:
                unit = self._next_job()
                if unit is None:
                    if time.monotonic() - idle_since > 30:
                        return  # restarted by the next plan or wait
                    self._jobs.wait(0.2)  # woken by plan, advance, a reader waiting, room given back
                    continue
                self._jobs.notify()  # there may be more: the next idle thread looks
            idle_since = time.monotonic()
            fd, error = None, None
            try:
                fd = self.files.fetch(unit)
            except Exception as e:  # noqa: BLE001 - recorded, raised in the reader that needs the shard
                error = e
            with self._cond:
                if fd is not None:
                    self._locks[unit.key] = fd
                    self._set(unit.key, _HELD)
                else:
                    self._set(unit.key, _FAILED)
                    self._errors[unit.key] = str(error) if isinstance(error, ShardError) else \
                        f"{unit.npy_url}: download failed: {type(error).__name__}: {error}"
                    self._add_used(-unit.size)
                self._cond.notify_all()

    def _count(self, name: str, n: int) -> None:
        with self._cond:
            self.stats[name] += n

    def _store(self) -> Downloader:
        if self.store is not None:
            return self.store
        if isinstance(self.units, ShardUnits):  # the root's backend (a pickled root opens again in each process)
            return self.units.root.storage
        raise ValueError("a ShardCache over a list of units is given the store they are downloaded from")

    def close(self) -> None:
        """Stop the download threads and release this process's hold on its files (they stay on disk
        for the next reader: a warm cache)."""
        self._stop.set()
        for thread in self._workers:
            thread.join(timeout=60)
        with self._cond:
            for fd in self._locks.values():
                os.close(fd)
            self._locks.clear()

    def __del__(self) -> None:
        stop = self.__dict__.get("_stop")
        if stop is not None:
            stop.set()
