"""Cleans up a local Ray instance after the run that started it, however that run ends.

``preprocess run`` without ``--ray-address`` starts its own Ray (GCS, raylet, agents, workers) and a session
directory under ``/tmp/ray``. ``ray.shutdown()`` stops most of that on a normal exit, but leaves the
session directory (39 MB over 201 runs in a day of testing), and a SIGKILLed driver runs no code at all:
its raylet's agents then live on ~60 s until they notice. So the driver starts this tiny process *before*
``ray.init`` (whose start-up takes 5-9 s: a driver killed then would otherwise leave the Ray it had begun
to start), holding the write end of a pipe to its stdin: when the driver ends (normally, by ``os._exit``
on a second Ctrl-C, or SIGKILL, at any moment), the kernel closes that pipe, the read here returns EOF,
and this process kills what is left of *that* Ray and removes *its* session directory.

Only what the run started is touched. For the length of ``ray.init`` the driver's environment carries
``RUN_MARK_VARIABLE`` set to a value of this run's own (``RayWatchdog.marking``): every process that Ray
starts inherits it (GCS, raylet, monitors, and the raylet's agents and workers in turn), and a process is
this Ray's when its environment holds that mark. Once ``ray.init`` returns the driver tells the watchdog
the session directory and the raylet's pid, and a process is also this Ray's when its command line names
that session directory, when its parent is that raylet, or when it is a ``ray::`` process whose
environment names that raylet (``RAY_RAYLET_PID``). Before the driver said it, the session directory is
the one named in a marked process's command line, or the one Ray names after the driver's pid
(``session_..._PID``) created since the watchdog started (a driver killed before Ray started any process).
Once the raylet dies its children are re-parented, so the watchdog notes the instance's processes every
``NOTE_EVERY_S`` while the driver lives and targets each of them (pid plus start time) until it is gone.
Other Ray instances on the machine (a test session's cluster, a user's own ``ray start``) carry no mark and
have other session directories and raylets. It runs in its own session (``start_new_session``) and
ignores SIGINT/SIGHUP/SIGTERM, so the Ctrl-C that stops the driver does not stop its cleanup.

Usage (by ``preprocess.cluster.ray_cluster``, through ``start_watchdog``): ``python -I .../ray_watchdog.py MARK
DRIVER_PID RAY_TEMP_DIR``; then lines on stdin: ``session SESSION_DIR``, ``raylet PID``.
"""

from __future__ import annotations

import glob
import os
import re
import secrets
import select
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["RUN_MARK_VARIABLE", "RayWatchdog", "start_watchdog", "session_processes", "clean_session"]

# After SIGTERM, Ray's processes exit within ~1 s; give them 5 before SIGKILL.
TERM_GRACE_S = 5.0
NOTE_EVERY_S = 1.0
# What every process of the Ray a run starts inherits from the driver's environment (see the docstring).
RUN_MARK_VARIABLE = "SHARDIO_RAY_RUN"


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return b""


def session_processes(session_dir: str, raylet_pids: list[int], live_raylets: list[int],
                      run_mark: str = "") -> list[int]:
    """Pids of this user's processes that belong to the Ray instance of ``session_dir`` ("" while it is not
    known yet) (``live_raylets``: those of ``raylet_pids`` still running as the same process, so a reused
    pid adopts nothing), or whose environment holds ``run_mark`` (``RUN_MARK_VARIABLE=MARK``)."""
    name = os.path.basename(session_dir.rstrip("/")).encode() if session_dir else b""
    raylet_marks = {f"RAY_RAYLET_PID={pid}".encode() for pid in raylet_pids}
    marked = f"{RUN_MARK_VARIABLE}={run_mark}".encode() if run_mark else b""
    mine = {os.getpid(), os.getppid()}
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in mine:
            continue
        cmdline = _read(f"/proc/{entry}/cmdline")
        if not cmdline:
            continue  # gone, a kernel thread, or not ours to read
        if (name and name in cmdline) or (live_raylets and _parent(int(entry)) in live_raylets):
            found.append(int(entry))
        elif marked or (cmdline.startswith(b"ray::") and raylet_marks):
            environ = set(_read(f"/proc/{entry}/environ").split(b"\0"))
            if (marked and marked in environ) or environ & raylet_marks:
                found.append(int(entry))
    return found


def _signal_all(pids: list[int], signum: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, signum)
        except (ProcessLookupError, PermissionError):
            pass


def _stat_fields(pid: int) -> list[str]:
    """/proc/PID/stat from field 3 (state) on: the command name in field 2 may hold spaces."""
    return _read(f"/proc/{pid}/stat").decode("ascii", "replace").rsplit(")", 1)[-1].split()


def _parent(pid: int) -> int:
    fields = _stat_fields(pid)
    return int(fields[1]) if len(fields) > 1 else 0


def _start_time(pid: int) -> str:
    """The process's start time (field 22 of /proc/PID/stat), "" once it is gone: a pid plus its start
    time names one process, never a later one that reused the pid."""
    fields = _stat_fields(pid)
    return fields[19] if len(fields) > 19 and fields[0] != "Z" else ""


def _alive(processes: dict[int, str]) -> list[int]:
    return [pid for pid, started in processes.items() if started and _start_time(pid) == started]


class _Watch:
    """What the watchdog knows of the Ray instance its driver starts: the run's mark, the driver's pid,
    the session directory and raylets once known, the processes seen (pid -> start time)."""

    def __init__(self, run_mark: str, driver_pid: int, ray_temp_dir: str) -> None:
        self.run_mark, self.driver_pid, self.ray_temp_dir = run_mark, driver_pid, ray_temp_dir
        self.started = time.time()
        self.session_dir = ""
        self.raylets: dict[int, str] = {}  # pid -> start time
        self.targets: dict[int, str] = {}

    def told(self, line: str) -> None:
        """A line from the driver: ``session DIR`` or ``raylet PID``."""
        what, _, value = line.strip().partition(" ")
        if what == "session" and value:
            self.session_dir = value
        elif what == "raylet" and value.isdigit():
            self.raylets[int(value)] = _start_time(int(value))

    def note(self) -> list[int]:
        """Add this instance's processes to the targets; return those still alive."""
        found = session_processes(self.session_dir, list(self.raylets), _alive(self.raylets), self.run_mark)
        for pid in found:
            self.targets.setdefault(pid, _start_time(pid))
        if not self.session_dir:
            self.session_dir = self._find_session_dir(found)
        return _alive(self.targets)

    def _find_session_dir(self, marked: list[int]) -> str:
        """The session directory before the driver said it: named in a marked process's command line, or
        named after the driver's pid and made since this watchdog started. "" if none (yet)."""
        named = re.compile(rf"[^\0=]*/session_[0-9_-]+_{self.driver_pid}(?=[/\0]|$)".encode())
        for pid in marked:
            found = named.search(_read(f"/proc/{pid}/cmdline"))
            if found:
                return found.group(0).decode("utf-8", "replace")
        for candidate in glob.glob(os.path.join(self.ray_temp_dir, f"session_*_{self.driver_pid}")):
            try:
                if os.lstat(candidate).st_mtime >= self.started - 1 and not os.path.islink(candidate):
                    return candidate
            except OSError:
                continue
        return ""


def clean_session(watch: _Watch) -> None:
    """Stop every process of this Ray instance (SIGTERM, then SIGKILL) and remove its session directory.

    A process once seen as this instance's (``watch.targets``: noted while the run was alive) stays a
    target until it is gone, even if it no longer looks like one by then (a Python process shutting down
    may restore its original command line; a raylet's pid dies with it). A process started meanwhile (a
    raylet starting an agent as the driver died) is noted by the next look, and killed in turn."""
    pids = watch.note()
    _signal_all(pids, signal.SIGTERM)
    deadline = time.monotonic() + TERM_GRACE_S
    while pids and time.monotonic() < deadline:
        time.sleep(0.1)
        pids = watch.note()
    for _ in range(20):  # SIGKILL until none is left: ~100 ms each, a bounded number of looks
        if not pids:
            break
        _signal_all(pids, signal.SIGKILL)
        time.sleep(0.05)
        pids = watch.note()
    session_dir = watch.session_dir
    if not session_dir:
        return
    shutil.rmtree(session_dir, ignore_errors=True)
    latest = os.path.join(os.path.dirname(session_dir.rstrip("/")), "session_latest")
    try:
        if os.path.islink(latest) and os.readlink(latest).rstrip("/") == session_dir.rstrip("/"):
            os.unlink(latest)  # it would dangle; a newer session re-creates it
    except OSError:
        pass


class RayWatchdog:
    """The driver's side: the watchdog process, the run's mark, and what to tell it."""

    def __init__(self, process: subprocess.Popen, run_mark: str) -> None:
        self.process, self.run_mark = process, run_mark

    @contextmanager
    def marking(self) -> Iterator[None]:
        """This process's environment carries the run's mark for the duration (``ray.init``): every process
        Ray starts meanwhile inherits it. Taken out again afterwards, so that nothing else this process
        starts later is mistaken for its Ray."""
        before = os.environ.get(RUN_MARK_VARIABLE)
        os.environ[RUN_MARK_VARIABLE] = self.run_mark
        try:
            yield
        finally:
            if before is None:
                os.environ.pop(RUN_MARK_VARIABLE, None)
            else:
                os.environ[RUN_MARK_VARIABLE] = before

    def tell(self, session_dir: str, raylet_pids: list[int]) -> None:
        """The session directory and raylets of the Ray this process started (once ``ray.init`` returned)."""
        lines = [f"session {session_dir}", *(f"raylet {pid}" for pid in raylet_pids)]
        try:
            self.process.stdin.write(("\n".join(lines) + "\n").encode())  # type: ignore[union-attr]
            self.process.stdin.flush()  # type: ignore[union-attr]
        except (BrokenPipeError, ValueError):
            pass  # it is gone (killed by someone): nothing more to tell

    def release(self, wait_s: float) -> None:
        """Let it clean up now (ray.shutdown has run, or ray.init failed), waiting up to ``wait_s``."""
        try:
            self.process.stdin.close()  # type: ignore[union-attr]
        except BrokenPipeError:
            pass
        try:
            self.process.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            pass


def start_watchdog(ray_temp_dir: str) -> RayWatchdog:
    """Start the watchdog for the local Ray this process is about to start (in ``RayWatchdog.marking``;
    Ray's session directories are made under ``ray_temp_dir``); ``release()`` (or this process ending, any
    way, at any moment) makes it clean up."""
    run_mark = secrets.token_hex(8)
    # Run as a script in isolated mode (-I): standard library only, so it starts in ~20 ms and needs
    # neither the package on sys.path nor anything from the environment.
    process = subprocess.Popen(
        [sys.executable, "-I", os.path.abspath(__file__), run_mark, str(os.getpid()), ray_temp_dir],
        stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        close_fds=True,
    )
    return RayWatchdog(process, run_mark)


def main(argv: list[str]) -> None:
    for signum in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)
    watch = _Watch(argv[0], int(argv[1]), argv[2])
    stdin = sys.stdin.buffer.raw
    pending = b""
    while True:
        # Readable: the driver said something, or ended (EOF: it has ended, or let go). Meanwhile note the
        # instance's processes every NOTE_EVERY_S (~1 ms of /proc reads for 130 processes).
        readable, _, _ = select.select([stdin], [], [], NOTE_EVERY_S)
        if readable:
            data = stdin.read(4096)
            if not data:
                break
            pending += data
            *lines, pending = pending.split(b"\n")
            for line in lines:
                watch.told(line.decode("utf-8", "replace"))
        watch.note()
    clean_session(watch)


if __name__ == "__main__":
    main(sys.argv[1:])
