"""Batches prepared ahead on a background thread, so the training loop only takes a ready one.

One implementation for ``ShardDataset`` iterated in the main process and for ``DeviceLoader``: the copy
out of the memory map (and pinning) runs outside the GIL on the thread while the step runs.
``prefetched(source, prepare, depth)`` is the generator for one iterable: it stops and joins the thread when
the consumer finishes, raises or drops it, and re-raises the thread's exception in the consumer.

**No wait at the epoch boundary** (``PassPrefetch``): a loader iterated epoch after epoch hands its passes to
``PassPrefetch.passes(key, source, prepare, depth, ahead)``. When the thread has prepared the last batch of a
pass it asks ``ahead()`` for the pass that would begin next if nothing changes (computed on a copy of the
cursor: ``ShardDataset.pass_ahead``), and prepares that pass's first ``depth`` batches while the consumer
still takes the last ones of this one. The next ``passes`` call whose ``key`` is that pass's continues on
those batches and the same thread; any other key (``set_epoch``, a loaded state, a new generation, other
settings) drops them and starts afresh. Nothing counts a batch before it is handed out, so ``state_dict`` is
what it was without this. The thread never waits for a next pass: having prepared its first ``depth``
batches it ends, leaving them (and the pass's iterator) to the ``PassPrefetch``, so a loader dropped after
its last epoch leaves no thread behind, only those batches until it is collected.
"""

from __future__ import annotations

import atexit
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["PassPrefetch", "Prefetcher", "prefetched"]

CLOSE_TIMEOUT_S = 60.0


class Prefetcher:
    """The prefetch thread and its queue: ``close()`` stops and joins it, whether the consumer finished,
    raised, or dropped the iterator; at interpreter exit every live one is closed first.

    Why the exit hook: an exception that ends the program keeps the iterator alive in its traceback until
    interpreter shutdown, and a daemon thread still inside a torch op then aborts the process ("terminate
    called without an active exception", SIGABRT, exit 134; 4 of 6 runs of a 64x128x128 CPU loader): a
    scheduler or torchrun sees a crash instead of the exception's exit 1.
    """

    live: set[Prefetcher] = set()

    def __init__(self, source: Iterator[Any], prepare: Callable[[Any], Any], depth: int,
                 ahead: Callable[[], tuple[Any, Iterator[Any]] | None] | None = None) -> None:
        # Room for a pass's end beside ``depth`` batches: the next pass's first ``depth`` fit behind it.
        self.slots: queue.Queue[Any] = queue.Queue(maxsize=depth + 1 if ahead is not None else depth)
        self.stop = threading.Event()
        self.source, self.prepare, self.depth, self.ahead = source, prepare, depth, ahead
        # The pass begun ahead: its key, and its iterator once the thread ended after its first batches.
        self.next_key: Any = None
        self._rest: Iterator[Any] | None = None
        self._lock = threading.Lock()
        self._claimed = False
        self._start()

    def _start(self) -> None:
        self.thread = threading.Thread(target=self._pull, name="shardio-prefetch", daemon=True)
        Prefetcher.live.add(self)
        self.thread.start()

    def _put(self, item: Any) -> bool:
        while not self.stop.is_set():
            try:
                self.slots.put(item, timeout=0.1)
                return True
            except queue.Full:
                pass
        return False

    def _produce(self, source: Iterator[Any], limit: int | None = None) -> bool:
        """Prepare and queue ``source``'s items (at most ``limit``); False once stopped."""
        count = 0
        while limit is None or count < limit:
            if self.stop.is_set():
                return False
            try:
                item = next(source)
            except StopIteration:
                return True
            if not self._put((self.prepare(item),)):
                return False
            count += 1
        return True

    def _pull(self) -> None:
        source = iter(self.source)
        self.source = None  # the thread holds it; a parked prefetcher holds only the pass begun ahead
        try:
            while True:
                if not self._produce(source):
                    return
                # The key of the pass that ends here (claimed, so this thread prepared it) is no key of a pass
                # begun ahead: cleared before the end is seen, a consumer that begins that same pass again
                # (set_epoch of the same epoch) never claims the one ``ahead()`` is still choosing.
                self.next_key = None
                if not self._put(_END):
                    return
                following = self.ahead() if self.ahead is not None else None
                if following is None:
                    return
                key, source = following[0], iter(following[1])
                self.next_key = key
                if not self._produce(source, self.depth):
                    return
                with self._lock:  # park, unless the consumer already claimed the pass: then go on with it
                    if not self._claimed:
                        self._rest = source
                        return
                    self._claimed = False
        except Exception as error:  # noqa: BLE001 - handed to the consumer, raised there
            self._put(_Failed(error))
        finally:
            if self.thread is threading.current_thread():
                Prefetcher.live.discard(self)  # ended by itself: nothing left to close at exit

    def claim(self) -> None:
        """The consumer takes the pass begun ahead (``next_key``): the thread goes on with it, or a new one
        takes over where it parked."""
        with self._lock:
            rest, self._rest = self._rest, None
            if rest is None:
                self._claimed = True  # still preparing its first batches: it goes on by itself
                return
        self.source = rest
        self._start()

    def get(self) -> Any:
        while True:
            try:
                return self.slots.get(timeout=0.1)
            except queue.Empty:
                if not self.thread.is_alive() and self.slots.empty():  # killed by a BaseException
                    raise RuntimeError("shardio prefetch thread ended without a batch or an error") from None

    def close(self) -> None:
        self.stop.set()
        # The thread ends at its next batch or put: a batch takes milliseconds to assemble, a worker start
        # a few seconds. A source stuck for good (a hung worker) must not hang the exit as well.
        deadline = time.monotonic() + CLOSE_TIMEOUT_S
        while self.thread.is_alive() and time.monotonic() < deadline:
            self.thread.join(timeout=0.1)
        Prefetcher.live.discard(self)
        while not self.slots.empty():  # drop prefetched batches now, not when the iterator is collected
            self.slots.get_nowait()


@atexit.register
def _close_prefetchers() -> None:
    for prefetcher in list(Prefetcher.live):
        prefetcher.close()


class _Failed:
    def __init__(self, error: BaseException) -> None:
        self.error = error


_END = object()


class PassPrefetch:
    """Passes prefetched one after another, the next one's first batches while the last ones of the current
    one are consumed (see the module docstring). One per loader (a ``ShardDataset``, a ``DeviceLoader``)."""

    def __init__(self) -> None:
        self.parked: Prefetcher | None = None

    def passes(self, key: Any, source: Callable[[], Iterator[Any]], prepare: Callable[[Any], Any], depth: int,
               ahead: Callable[[], tuple[Any, Iterator[Any]] | None], length: int | None = None) -> Iterator[Any]:
        """``prepare(item)`` for every item of the pass ``key`` (``source()`` makes its items, unless the
        pass was begun ahead), up to ``depth`` items ahead on a thread that then begins ``ahead()``'s
        ``(key, items)``: the next pass if nothing changes. ``length``: the pass's items, when known; its
        end is then taken before its last item is handed out, so a consumer that stops after ``length``
        items without asking for more (Lightning, with a loader's ``len``) still keeps what was begun."""
        parked, self.parked = self.parked, None
        prefetcher = None
        if parked is not None:
            if parked.next_key is not None and parked.next_key == key:
                parked.claim()
                prefetcher = parked
            else:
                parked.close()
        if prefetcher is None:
            prefetcher = Prefetcher(source(), prepare, depth, ahead)
        ended, handed, pending = False, 0, None
        try:
            while True:
                item, pending = (pending if pending is not None else prefetcher.get()), None
                if item is _END:
                    ended = True
                    self.parked = prefetcher  # preparing the next pass's first batches
                    return
                if isinstance(item, _Failed):
                    raise item.error
                handed += 1
                if handed == length:  # the last one: take the end first, then hand it out
                    pending = prefetcher.get()
                    if pending is _END:
                        ended, pending = True, None
                        self.parked = prefetcher
                        yield item[0]
                        return
                yield item[0]
        finally:
            if not ended:
                prefetcher.close()

    def close(self) -> None:
        """Drop the batches begun ahead (and stop their thread)."""
        parked, self.parked = self.parked, None
        if parked is not None:
            parked.close()

    def join_ahead(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """Wait until the pass begun ahead has its first batches (its thread ended after them): what a
        loader iterated to its end has done by then is fixed (for tests and measurements)."""
        parked = self.parked
        if parked is not None:
            parked.thread.join(timeout)

    def __getstate__(self) -> dict[str, Any]:
        return {"parked": None}  # a copy (a DataLoader worker's) begins its own passes


def prefetched(source: Iterator[Any], prepare: Callable[[Any], Any], depth: int) -> Iterator[Any]:
    """``prepare(item)`` for every item of ``source``, computed up to ``depth`` items ahead on a thread."""
    prefetcher = Prefetcher(source, prepare, depth)
    try:
        while True:
            item = prefetcher.get()
            if item is _END:
                return
            if isinstance(item, _Failed):
                raise item.error
            yield item[0]
    finally:
        prefetcher.close()
