"""The one-writer lock of a dataset on object storage: a lease object, taken and renewed with conditional
writes. (Local directories use ``flock``: ``shardio.store.local.lock``.)

``DIR/.lock`` holds JSON ``{holder, host, pid, expires}``. Taking it: put-if-absent. A lease whose
``expires`` has passed (its holder died: nobody renewed it) is taken over with ``If-Match`` on the ETag
just read, so of two waiters only one wins. The holder renews it every third of its life, again with
``If-Match`` on its own last ETag: a holder that was paused past expiry and lost the lease to another run
sees the renewal refused, stops renewing, and its commit is refused (``LeaseHandle.check``); its
manifest write carries ``If-Match`` too, so it can never overwrite the new holder's commit. Released by
deleting the object. A lease of a dead process on this very host is taken over at once (no wait for the
expiry): a ``kill -9`` followed by a rerun on the same machine is the common case.

The expiry uses the holder's clock: hosts must agree to within the lease's life (60 s by default,
``SHARDIO_LEASE_SECONDS``); NTP keeps them within milliseconds.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from shardio.errors import CommitConflict, OutputLocked, StorageUnavailable
from shardio.store.holders import pid_alive

__all__ = ["lease", "LeaseHandle", "lease_seconds"]


def lease_seconds() -> float:
    return float(os.environ.get("SHARDIO_LEASE_SECONDS", "60"))


class LeaseHandle:
    """The held lease: renewed on a daemon thread until released."""

    def __init__(self, store: Any, path: str, etag: str, ttl_s: float) -> None:
        self.store, self.path, self.etag, self.ttl_s = store, path, etag, ttl_s
        self.lost: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._renew_loop, name="shardio-lease", daemon=True)
        self._thread.start()

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            try:
                self.etag = self.store.publish(self.path, _body(self.ttl_s), if_version=self.etag)
            except CommitConflict:
                self.lost = f"{self.path}: the lease was taken over by another run (this run was paused past its expiry)"
                return
            except (StorageUnavailable, OSError):
                continue  # the store is down for a moment: keep trying; check() refuses once it expired

    def check(self) -> None:
        """Raise ``OutputLocked`` if the lease was lost: nothing may be committed or deleted then."""
        if self.lost is not None:
            raise OutputLocked(self.lost)

    def release(self) -> None:
        self._stop.set()
        self._thread.join()
        if self.lost is not None:
            return
        try:
            _, etag = self.store.read_versioned(self.path)
            if etag == self.etag:
                self.store.remove(self.path)
        except (FileNotFoundError, StorageUnavailable):
            pass  # gone already, or the store is down: it expires by itself


def _body(ttl_s: float) -> bytes:
    return json.dumps({
        "holder": f"pid {os.getpid()} on {socket.gethostname()}",
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "expires": time.time() + ttl_s,
    }).encode()


def _stale(doc: dict[str, Any]) -> bool:
    if float(doc.get("expires", 0)) < time.time():
        return True
    pid = doc.get("pid")
    return doc.get("host") == socket.gethostname() and isinstance(pid, int) and pid != os.getpid() \
        and not pid_alive(pid)


def _acquire(store: Any, path: str, wait: bool, ttl_s: float, poll_s: float) -> LeaseHandle:
    while True:
        try:
            return LeaseHandle(store, path, store.publish_new(path, _body(ttl_s)), ttl_s)
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
            try:
                return LeaseHandle(store, path, store.publish(path, _body(ttl_s), if_version=etag), ttl_s)
            except CommitConflict:
                continue  # another waiter took it first
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
