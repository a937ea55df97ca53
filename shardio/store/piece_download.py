"""How an object store's download fetches (``download``, the reader's cache's one way in, which
``ObjectStorage.download`` calls with its ranged GET): the object in pieces of 8 MB, the
first with one GET that also says the object's size (an object of 8 MB or less is that one GET), the rest as
ranged GETs at once, each written with ``pwrite`` at its offset into the file, sized in advance, and hashed
in order from memory as the pieces arrive (one that comes early waits for those before it; reading the file
back instead cost 0.1-0.2 CPU s/GB more on 2 cores, ``bench.fetch_paths``). Every GET of a download,
in any thread, first takes its length from the process's budget of bytes in flight (``BYTES_IN_FLIGHT``,
64 MB: eight 8 MB pieces, or 32 small shards of 2 MB): concurrency is set by bytes, not by objects. The
pieces after a download's first go to the process's fetch threads (``FETCH_THREADS``), so a large shard is
fetched by many connections at once when few downloads run (a single S3 connection carries ~100 MB/s), and
when many run they share the same budget instead of adding requests (on a 2-core machine serving its own
loopback store, more requests at once only cost CPU). Pieces that came early and wait to be hashed are held
beyond the budget (at most the pieces of one download in flight). A piece whose
answer is cut or short (beyond what obstore's own retries recover) is fetched again, up to ``attempts``
times; a failed download leaves an empty file, never one of the right size with holes in it.

How long a fault can last (the object stores' settings, ``shardio.store.object_store``): a request that
gets no answer fails after ``CLIENT_OPTIONS["timeout"]`` (300 s: an 8 MB piece at 30 KB/s), one that cannot
connect after 5 s; obstore retries either for up to 60 s (``retry_config``); a piece is tried ``attempts``
(3) times. A dead or stalled server therefore ends a download with ``StorageUnavailable`` naming the URL
within 3 x (300 + 60) s at most, and in about 3 minutes when nothing answers at all; never a hang.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from shardio.errors import StorageUnavailable
from shardio.store.checksum import new_hasher

__all__ = ["BYTES_IN_FLIGHT", "FETCH_THREADS", "PIECE_BYTES", "GetRange", "download"]

# A download's pieces: 8 MB, the part size AWS suggests for parallel GETs.
PIECE_BYTES = 8 << 20
# The bytes all GETs of the process's downloads may have in flight at once, and the fetch threads that take
# a download's pieces after its first (they wait for the budget like every GET).
BYTES_IN_FLIGHT = 64 << 20
FETCH_THREADS = 8

# One ranged GET of the object: (start, length) -> (the bytes, the whole object's size). The first piece
# asks for up to ``length`` bytes of an object of unknown size; a store may answer it whole.
GetRange = Callable[[int, int], tuple[Any, int]]


def download(get_range: GetRange, path: str, local_path: str, algorithm: str, attempts: int = 3) -> str:
    """The whole object at ``path`` into ``local_path`` (module docstring); returns the ``algorithm``
    checksum of the bytes written. Memory stays bounded: a piece is 8 MB, and the fetch threads are shared by
    all downloads. On any failure the file is left empty."""
    digest = new_hasher(algorithm)  # before any request: a missing xxhash says so at once
    fd = os.open(local_path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        first = _piece(get_range, path, 0, PIECE_BYTES, attempts)
        size = first.size
        os.ftruncate(fd, size)  # the pieces land at their offsets, in any order
        _write_at(fd, first.data, 0)
        digest.update(first.data)
        rest = [(start, min(PIECE_BYTES, size - start)) for start in range(len(first.data), size, PIECE_BYTES)]
        del first
        if rest:
            _Pieces(get_range, path, fd, rest, attempts, digest).fetch()
    except BaseException:
        os.ftruncate(fd, 0)  # never a file of the right size with a hole where a piece failed
        raise
    finally:
        os.close(fd)
    return digest.hexdigest()


def _piece(get_range: GetRange, path: str, start: int, length: int, attempts: int) -> _Piece:
    """Bytes ``start`` .. ``start + length`` of the object (the first piece: up to ``length``, and the
    object's size), fetched again if the body is cut or comes back short, up to ``attempts`` times."""
    # A first piece's length is not known before its answer: it holds the size first pieces have had
    # lately (a 2 MB shard's GET holds 2 MB, not 8).
    held = _FETCH.first_piece_guess(length) if start == 0 else length
    for attempt in range(attempts):
        try:
            with _FETCH.budget(held):
                data, size = get_range(start, length)
            expected = min(length, size - start)
            if len(data) != expected and not (start == 0 and len(data) == size):  # whole: a range ignored
                raise StorageUnavailable(f"{path}: GET of bytes {start}-{start + expected} returned "
                                         f"{len(data)} bytes (the object is {size}): a cut or changed answer")
            if start == 0:
                _FETCH.first_piece_was(len(data))
            return _Piece(data, size)
        except StorageUnavailable:
            if attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")


class _Piece:
    __slots__ = ("data", "size")

    def __init__(self, data: Any, size: int) -> None:
        self.data, self.size = data, size  # the piece's bytes (a buffer), the whole object's size


def _write_at(fd: int, data: Any, offset: int) -> None:
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written


class _FetchThreads:
    """The process's fetch threads (``FETCH_THREADS``, daemons, started as work comes), which take every
    download's pieces after its first, and the budget of bytes in flight every GET holds. Made anew in a
    forked child (threads do not survive a fork)."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._started = 0
        self._room = threading.Condition()
        self._in_flight = 0
        self._first_piece: float | None = None  # the recent first pieces' length (a moving average)

    def first_piece_guess(self, length: int) -> int:
        return length if self._first_piece is None else max(1, min(length, int(self._first_piece)))

    def first_piece_was(self, nbytes: int) -> None:
        previous = self._first_piece
        self._first_piece = float(nbytes) if previous is None else 0.8 * previous + 0.2 * nbytes

    @contextmanager
    def budget(self, nbytes: int) -> Iterator[None]:
        """Hold ``nbytes`` of ``BYTES_IN_FLIGHT`` while a GET runs (one GET larger than the budget runs
        alone). Nothing that holds it waits for anything but its own request: no circle."""
        nbytes = min(nbytes, BYTES_IN_FLIGHT)
        with self._room:
            while self._in_flight and self._in_flight + nbytes > BYTES_IN_FLIGHT:
                self._room.wait()
            self._in_flight += nbytes
        try:
            yield
        finally:
            with self._room:
                self._in_flight -= nbytes
                self._room.notify_all()

    def submit(self, job: Any) -> None:
        self._jobs.put(job)
        with self._lock:
            if self._started < FETCH_THREADS:
                self._started += 1
                threading.Thread(target=self._work, name="shardio-fetch", daemon=True).start()

    def _work(self) -> None:
        while True:
            self._jobs.get()()


_FETCH = _FetchThreads()


def _new_fetch_threads() -> None:
    global _FETCH
    _FETCH = _FetchThreads()


os.register_at_fork(after_in_child=_new_fetch_threads)


class _Pieces:
    """The pieces of one download after its first: taken one at a time by the fetch threads and by the
    downloading thread itself (so a download always moves, however busy the fetch threads are with others);
    the first failure stops the rest and is raised to the downloading thread."""

    def __init__(self, get_range: GetRange, path: str, fd: int, pieces: list[tuple[int, int]], attempts: int,
                 digest: Any) -> None:
        self.get_range, self.path, self.fd = get_range, path, fd
        self.pieces, self.attempts, self.digest = pieces, attempts, digest
        self._hashed = pieces[0][0]  # the bytes before this offset are in the digest
        self._early: dict[int, Any] = {}  # pieces written but not hashed yet: one before them is still coming
        self._hash_lock = threading.Lock()
        self._lock = threading.Lock()
        self._next = 0
        self._running = 0
        self._done = threading.Condition(self._lock)
        self.error: BaseException | None = None

    def fetch(self) -> None:
        for _ in range(min(len(self.pieces) - 1, FETCH_THREADS)):
            _FETCH.submit(self._take)
        self._take()
        with self._done:
            while self._running or (self._next < len(self.pieces) and self.error is None):
                self._done.wait()
            if self.error is not None:
                raise self.error
        end = self.pieces[-1][0] + self.pieces[-1][1]
        if self._hashed != end:
            raise AssertionError(f"{self.path}: hashed up to {self._hashed} of {end} bytes")

    def _hash(self, start: int, data: Any) -> None:
        """Feed the digest in order: ``data`` now if it is next, else when the pieces before it are in."""
        with self._hash_lock:
            self._early[start] = data
            while self._hashed in self._early:
                piece = self._early.pop(self._hashed)
                self.digest.update(piece)
                self._hashed += len(piece)

    def _take(self) -> None:
        while True:
            with self._lock:
                if self.error is not None or self._next >= len(self.pieces):
                    return
                start, length = self.pieces[self._next]
                self._next += 1
                self._running += 1
            try:
                piece = _piece(self.get_range, self.path, start, length, self.attempts)
                _write_at(self.fd, piece.data, start)
                self._hash(start, piece.data)
            except BaseException as e:  # noqa: BLE001 - raised in the downloading thread
                with self._lock:
                    self.error = self.error or e
            finally:
                with self._done:
                    self._running -= 1
                    self._done.notify_all()
