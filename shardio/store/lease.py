"""The one-writer lock of a dataset on object storage: a lease object, taken and renewed with conditional
writes. (Local directories use ``flock``: ``shardio.store.local.lock``.)

``DIR/.lock`` holds JSON ``{holder, host, pid, expires, token}``. Taking it: put-if-absent. A lease
whose ``expires`` has passed (its holder died, or stopped renewing: paused, cut off from the store) is
taken over with ``If-Match`` on the ETag just read, so of two waiters only one wins. A lease of a dead
process on this very host is taken over at once (no wait for the expiry): a ``kill -9`` followed by a
rerun on the same machine is the common case. Released by deleting the object.

The holder renews it every third of its life, with ``If-Match`` on its own last ETag: a holder that lost
the lease to another run sees the renewal refused and stops. A renewal whose answer was lost (the PUT
landed, the reply did not) is recognised by the ``token`` of this holder in the object, and the holder
goes on.

**What a holder may do, and when** (``LeaseHandle.check``, called before every commit step and every
deletion): only while it can prove it still holds the lease, that is while ``valid_until`` (the monotonic
time its last successful renewal was sent + the lease's life - ``SAFETY_FRACTION`` of it) has not
passed. Past it (renewals failing: the store unreachable, the lease requests refused, the process
paused), ``check`` tries one renewal at once and raises ``OutputLocked`` unless it succeeds: a writer
that cannot prove its lease neither commits nor deletes. A monotonic clock measures this, so a jump of
the wall clock on the holder's host changes nothing; the expiry another run reads is the holder's wall
clock, so hosts must agree to within the margin (a third of the lease: 20 s of the default 60 s,
``SHARDIO_LEASE_SECONDS``); NTP keeps them within milliseconds.

A check is not a fence on its own: a holder paused between its check and its request reaches the store
late. The commit is fenced by the store itself: a run that takes a lease over (``taken_over``) first
publishes a new generation over the ``manifest.json`` it read (``shardio.write.directory``, "fencing"),
so the previous holder's ``If-Match`` on its own last version can never succeed again, and only then
deletes anything. A previous holder's own deletions cannot be fenced by the store (no conditional DELETE
on S3): a run that took the lease over from a holder that may live (``holder_may_live``) writes its
shards under names that holder never knew (``shardio.format.spec``, "Fencing names"), so whatever it
deletes late is its own.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from shardio.errors import CommitConflict, OutputLocked, StorageUnavailable
from shardio.store.holders import pid_alive

__all__ = ["lease", "LeaseHandle", "lease_seconds", "SAFETY_FRACTION"]

# The part of a lease's life a holder does not count on: the renewal it may miss (one of three), the
# clock skew between hosts and the time a request takes to reach the store after its check.
SAFETY_FRACTION = 1 / 3


def lease_seconds() -> float:
    return float(os.environ.get("SHARDIO_LEASE_SECONDS", "60"))


class LeaseHandle:
    """The held lease: renewed on a daemon thread until released. ``taken_over``: it was taken from
    another holder (expired, or dead on this host), who may still be about to commit: the directory
    protocol fences it out before deleting anything. ``holder_may_live``: taken over because it expired,
    so its holder may be alive (paused, cut off) and send requests later, deletions included (a holder
    proven dead on this host sends nothing). ``sent_at``: the monotonic time the request that wrote the
    lease was sent."""

    def __init__(self, store: Any, path: str, etag: str, ttl_s: float, token: str, sent_at: float,
                 taken_over: bool = False, holder_may_live: bool = False) -> None:
        self.store, self.path, self.etag, self.ttl_s, self.token = store, path, etag, ttl_s, token
        self.taken_over = taken_over
        self.holder_may_live = holder_may_live
        self.lost: str | None = None
        self.valid_until = sent_at + ttl_s * (1 - SAFETY_FRACTION)
        self.last_failure = ""
        self._renewing = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._renew_loop, name="shardio-lease", daemon=True)
        self._thread.start()

    def _renew_loop(self) -> None:
        pause = self.ttl_s / 3
        while not self._stop.wait(pause):
            with self._renewing:
                renewed = self._renew()
            if self.lost is not None:
                return
            pause = self.ttl_s / 3 if renewed else self.ttl_s / 10  # a failed one is tried again sooner

    def _renew(self) -> bool:
        """One renewal (the caller holds ``_renewing``): True if it succeeded; a takeover sets ``lost``."""
        if self.lost is not None:
            return False
        for _ in range(2):  # a second try only after finding our own write behind a lost answer
            sent_at = time.monotonic()
            try:
                self.etag = self.store.publish(self.path, _body(self.ttl_s, self.token), if_version=self.etag)
                self.valid_until = sent_at + self.ttl_s * (1 - SAFETY_FRACTION)
                return True
            except CommitConflict:
                if self._adopt_own_write():
                    continue
                self.lost = (f"{self.path}: the lease was taken over by another run (this run could not renew it "
                             "before it expired: paused, or cut off from the store)")
                return False
            except (StorageUnavailable, OSError) as e:
                self.last_failure = str(e)  # the store is down for a moment: keep trying; check() refuses
                return False
        return False

    def _adopt_own_write(self) -> bool:
        """After a refused renewal: whether the lease object is still this holder's (a renewal that landed
        but whose answer was lost); then its ETag is taken."""
        try:
            data, etag = self.store.read_versioned(self.path)
            doc = json.loads(data)
        except (FileNotFoundError, StorageUnavailable, OSError, ValueError):
            return False
        if isinstance(doc, dict) and doc.get("token") == self.token:
            self.etag = etag
            return True
        return False

    def check(self) -> None:
        """Raise ``OutputLocked`` unless this holder can prove it still holds the lease (its last renewal
        is recent enough, or one made now succeeds): nothing may be committed or deleted otherwise."""
        if self.lost is None and time.monotonic() < self.valid_until:
            return
        if self.lost is None and self._renewing.acquire(blocking=False):
            try:
                self._renew()
            finally:
                self._renewing.release()
            if self.lost is None and time.monotonic() < self.valid_until:
                return
        if self.lost is not None:
            raise OutputLocked(self.lost)
        cause = f" (last: {self.last_failure})" if self.last_failure else ""
        raise OutputLocked(f"{self.path}: this run cannot prove it still holds the lease: the store has not "
                           f"accepted its renewals for the last {self.ttl_s * (1 - SAFETY_FRACTION):.0f} s{cause}, "
                           "so another run may have taken it over; nothing more is committed or deleted. Rerun "
                           "once the store answers: committed inputs are skipped")

    def release(self) -> None:
        self._stop.set()
        self._thread.join()
        if self.lost is not None:
            return
        try:
            data, etag = self.store.read_versioned(self.path)
            if etag == self.etag or _token(data) == self.token:
                self.store.remove(self.path)
        except (FileNotFoundError, StorageUnavailable, OSError):
            pass  # gone already, or the store is down: it expires by itself


def _token(data: bytes) -> str:
    try:
        doc = json.loads(data)
    except ValueError:
        return ""
    return str(doc.get("token", "")) if isinstance(doc, dict) else ""


def _body(ttl_s: float, token: str) -> bytes:
    return json.dumps({
        "holder": f"pid {os.getpid()} on {socket.gethostname()}",
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "expires": time.time() + ttl_s,
        "token": token,
    }).encode()


def _stale(doc: dict[str, Any]) -> bool:
    return _dead_here(doc) or float(doc.get("expires", 0)) < time.time()


def _dead_here(doc: dict[str, Any]) -> bool:
    """The holder is a process of this host that no longer runs: it sends nothing more, ever."""
    pid = doc.get("pid")
    return doc.get("host") == socket.gethostname() and isinstance(pid, int) and pid != os.getpid() \
        and not pid_alive(pid)


def _acquire(store: Any, path: str, wait: bool, ttl_s: float, poll_s: float) -> LeaseHandle:
    token = secrets.token_hex(8)
    while True:
        sent_at = time.monotonic()
        try:
            return LeaseHandle(store, path, store.publish_new(path, _body(ttl_s, token)), ttl_s, token, sent_at)
        except FileExistsError:
            pass
        try:
            data, etag = store.read_versioned(path)
        except FileNotFoundError:
            continue  # released between the two requests: try to create it again
        try:
            doc = json.loads(data)
        except ValueError:
            doc = {}  # unreadable: treat as expired
        if not isinstance(doc, dict) or _stale(doc):
            sent_at = time.monotonic()
            try:
                etag = store.publish(path, _body(ttl_s, token), if_version=etag)
            except CommitConflict:
                continue  # another waiter took it first
            return LeaseHandle(store, path, etag, ttl_s, token, sent_at, taken_over=True,
                               holder_may_live=not (isinstance(doc, dict) and _dead_here(doc)))
        if not wait:
            left = max(0.0, float(doc.get("expires", 0)) - time.time())
            raise OutputLocked(
                f"{path}: another run is writing this output ({doc.get('holder', 'unknown')}; its lease "
                f"expires in {left:.0f} s unless renewed); it will be picked up by the next run, or pass --wait "
                "to queue behind it")
        time.sleep(poll_s)


@contextmanager
def lease(store: Any, path: str, wait: bool = False, poll_s: float = 1.0) -> Iterator[LeaseHandle]:
    """Hold the lease at ``path`` for the block (``OutputLocked`` if a live holder has it, unless
    ``wait``)."""
    handle = _acquire(store, path, wait, lease_seconds(), poll_s)
    try:
        yield handle
    finally:
        handle.release()
