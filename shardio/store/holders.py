"""Who holds a dataset directory's one-writer lock, as a reader can tell without taking it, and whether a
process is alive (the local lock's note and the object-storage lease both name a pid on a host)."""

from __future__ import annotations

import json
import os
import time

from shardio.errors import ShardioError
from shardio.store.base import LOCK_NAME, Storage

__all__ = ["pid_alive", "writer_holding"]


def pid_alive(pid: int) -> bool:
    """Whether a process with this PID runs on this host (another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's live process
    return True



def writer_holding(store: Storage, directory: str) -> str:
    """Who holds the one-writer lock of ``directory`` ("pid 123 on host"), "" if nobody does, as far as
    a reader can tell without taking it (a reader must never make a starting run fail to take the lock).

    The lock file's note says who: locally ``pid N on HOST`` while held (emptied at release; a SIGKILLed
    holder leaves it, so a dead pid on this host is nobody), on object storage the lease's JSON (held until
    ``expires``). A holder on another host is taken at its word."""
    try:
        note = store.read_bytes(store.join(directory, LOCK_NAME)).decode("utf-8", "replace").strip()
    except (OSError, ValueError, ShardioError):
        return ""  # no lock file (never written), or unreadable: the caller says what else it sees
    if note.startswith("{"):
        try:
            doc = json.loads(note)
            holder, host, pid, expires = doc["holder"], doc.get("host"), doc.get("pid"), float(doc["expires"])
        except (ValueError, KeyError, TypeError):
            return ""
    else:
        pid_text, _, host = note.removeprefix("pid ").partition(" on ")
        if not pid_text.isdigit() or not host:
            return ""
        holder, pid, expires = note, int(pid_text), float("inf")
    if expires < time.time():
        return ""
    if host == os.uname().nodename and isinstance(pid, int) and pid != os.getpid() and not pid_alive(pid):
        return ""
    return str(holder)
