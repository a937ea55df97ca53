"""CPU seconds so far, the whole machine's or a process tree's, for benches whose server shares the client's
cores."""

from __future__ import annotations

import os

__all__ = ["machine_cpu_s", "tree_cpu_s", "TreeCpu"]


def machine_cpu_s() -> float:
    """CPU seconds every process of the machine has used (a loopback server's too): /proc/stat less idle and
    iowait; 0 where there is no /proc/stat."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except OSError:
        return 0.0
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def tree_cpu_s(root: int, leave_out: tuple[int, ...] = ()) -> dict[int, float]:
    """CPU seconds (user + system) so far of process ``root`` and its descendants, by pid, the trees under
    ``leave_out`` not: a job's own processes (its driver, Ray's daemons and workers) without the bench's server.
    Kernel threads are no one's descendants: the writeback of a server's files is not charged to the job."""
    import psutil

    seen: dict[int, float] = {}
    try:
        top = psutil.Process(root)
        processes = [top, *top.children(recursive=True)]
    except psutil.NoSuchProcess:
        return seen
    skipped: set[int] = set(leave_out)
    for pid in leave_out:
        try:
            skipped.update(child.pid for child in psutil.Process(pid).children(recursive=True))
        except psutil.NoSuchProcess:
            pass
    for process in processes:
        if process.pid in skipped:
            continue
        try:
            times = process.cpu_times()
        except psutil.NoSuchProcess:
            continue
        seen[process.pid] = times.user + times.system
    return seen


class TreeCpu:
    """``with TreeCpu(root, leave_out) as cpu: ...`` then ``cpu.seconds``: what the tree used within the block
    (a process started in it counts whole; one that ended in it is missed, as its last times cannot be read)."""

    def __init__(self, root: int, leave_out: tuple[int, ...] = ()) -> None:
        self.root, self.leave_out = root, leave_out
        self.seconds = 0.0

    def __enter__(self) -> TreeCpu:
        self._before = tree_cpu_s(self.root, self.leave_out)
        return self

    def __exit__(self, *exc: object) -> None:
        after = tree_cpu_s(self.root, self.leave_out)
        self.seconds = sum(max(0.0, used - self._before.get(pid, 0.0)) for pid, used in after.items())
