"""Where each process of a cache group is in the pass: one small memory-mapped file in the cache directory.

The processes sharing a cache directory plan one sequence (``shardio.read.cache.cache_group``); to keep the directory
at one ``cache_limit`` the one that downloads ahead must not make room by letting go of what a slower process of the
group is still to read. Each process writes its step into its slot as it starts a batch; the slowest slot is where
the group is. File: ``CACHE_DIR/groups/NAME.steps``, ``NAME`` the group's (a token its first rank drew when the
dataset opened, so a run never reads another run's slots); per slot three little-endian int64: the pass (epoch + 1,
start: a slot never written, all zeros, is in no pass) and the step. A slot of another pass is a process that has not
begun this one (at step 0: all it will read is kept, for ``BEGIN_GRACE_S`` after this process began it; later it is
taken for one that reads something else, a rank that opened the dataset and never iterates it) or, for a later pass,
one done with it. Nothing here is trusted for correctness: a wrong slot costs a download, a little room or a wait of
``cache_room.HOLD_BACK_S`` at most, never a wrong byte. Files a day old are removed by the next pass of any process
(``prune``).
"""

from __future__ import annotations

import mmap
import os
import time

import numpy as np

__all__ = ["GroupPositions", "prune"]

FIELDS = 3  # epoch, start, step
STALE_S = 24 * 3600.0
# How long a process that has not begun this process's pass counts as about to (at step 0).
BEGIN_GRACE_S = 10.0


class GroupPositions:
    """Slot ``slot`` of ``slots`` in the group ``name``'s file under ``cache_dir``."""

    def __init__(self, cache_dir: str, name: str, slots: int, slot: int) -> None:
        folder = os.path.join(cache_dir, "groups")
        os.makedirs(folder, exist_ok=True)
        self.path = os.path.join(folder, f"{name}.steps")
        self.slot, self.slots = slot, slots
        size = slots * FIELDS * 8
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o666)
        try:
            if os.fstat(fd).st_size < size:
                os.ftruncate(fd, size)  # zeros: every slot in no pass yet
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self._slots = np.frombuffer(self._map, dtype="<i8").reshape(slots, FIELDS)
        self._pass = (0, 0)  # (epoch + 1, start) of this process's pass, as its slot holds it
        self._begun = float("-inf")  # when this process began its pass (``time.monotonic``)

    def begin(self, epoch: int, start: int) -> None:
        """This process begins the pass ``(epoch, start)``, at step 0 (the step first, so a reader never sees the
        new pass with the old step)."""
        self._pass, self._begun = (int(epoch) + 1, int(start)), time.monotonic()  # as written: 0 is no pass
        self._slots[self.slot, 2] = 0
        self._slots[self.slot, 0:2] = self._pass
        try:
            os.utime(self.path)  # written through the map: its time says the group is alive (``prune``)
        except OSError:
            pass

    def at(self, step: int) -> None:
        """This process starts step ``step`` of its pass."""
        self._slots[self.slot, 2] = step

    def slowest(self) -> int:
        """The step of the slowest process of the group in this process's pass (0 for one yet to begin it, within
        ``BEGIN_GRACE_S`` of this process's beginning; a process in a later pass is done with this one)."""
        return self._slowest(time.monotonic() - self._begun < BEGIN_GRACE_S)

    def slowest_reading(self) -> int:
        """The step of the slowest process reading this process's pass now, those yet to begin it left out (one that
        never begins it, a rank that opened the dataset and reads another, holds no one back)."""
        return self._slowest(False)

    def _slowest(self, wait_for_new: bool) -> int:
        rows = self._slots.copy()
        mine = np.array(self._pass, dtype=np.int64)
        here = (rows[:, 0] == mine[0]) & (rows[:, 1] == mine[1])
        later = (rows[:, 0] > mine[0]) | ((rows[:, 0] == mine[0]) & (rows[:, 1] > mine[1]))
        done = np.iinfo(np.int64).max
        steps = np.where(here, rows[:, 2], np.where(later, done, 0 if wait_for_new else done))
        return int(steps.min())


def prune(cache_dir: str) -> None:
    """Remove group files no process has written for a day (the runs are long gone)."""
    folder = os.path.join(cache_dir, "groups")
    try:
        names = os.listdir(folder)
    except OSError:
        return
    now = time.time()
    for name in names:
        if not name.endswith(".steps"):
            continue
        path = os.path.join(folder, name)
        try:
            if now - os.stat(path).st_mtime > STALE_S:
                os.remove(path)
        except OSError:
            pass  # gone, or another user's
