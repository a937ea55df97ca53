"""Batches prepared ahead on a background thread, so the training loop only takes a ready one.

One implementation for ``ShardDataset`` iterated in the main process and for ``DeviceLoader``: the copy
out of the memory map (and pinning) runs outside the GIL on the thread while the step runs.
``prefetched(source, prepare, depth)`` is the generator both use: it stops and joins the thread when the
consumer finishes, raises or drops it, and re-raises the thread's exception in the consumer.
"""

from __future__ import annotations

import atexit
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["Prefetcher", "prefetched"]

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

    def __init__(self, source: Iterator[Any], prepare: Callable[[Any], Any], depth: int) -> None:
        self.slots: queue.Queue[Any] = queue.Queue(maxsize=depth)
        self.stop = threading.Event()
        self.source, self.prepare = source, prepare
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

    def _pull(self) -> None:
        try:
            for batch in self.source:
                if self.stop.is_set():
                    return
                if not self._put((self.prepare(batch),)):
                    return
            self._put(_END)
        except Exception as error:  # noqa: BLE001 - handed to the consumer, raised there
            self._put(_Failed(error))

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
