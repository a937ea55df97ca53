"""Cleans up a local Ray instance after the run that started it, however that run ends.

``preprocess run`` without ``--ray-address`` starts its own Ray (GCS, raylet, agents, workers) and a session
directory under ``/tmp/ray``. ``ray.shutdown()`` stops most of that on a normal exit, but leaves the
session directory (39 MB over 201 runs in a day of testing), and a SIGKILLed driver runs no code at all:
its raylet's agents then live on ~60 s until they notice. So the driver starts this tiny process next to
the Ray it started, holding the write end of a pipe to its stdin: when the driver ends (normally, by
``os._exit`` on a second Ctrl-C, or SIGKILL), the kernel closes that pipe, the read here returns EOF, and
this process kills what is left of *that* Ray and removes *its* session directory.

Only what the run started is touched: a process is this Ray's when its command line names this session
directory (GCS, raylet, monitors), when its parent is this session's raylet (agents, workers), or when it
is a ``ray::`` process whose environment names that raylet (``RAY_RAYLET_PID``: workers whose raylet is
already gone). Agents' environments are not always readable, and once the raylet dies its children are
re-parented, so the watchdog notes the instance's processes every ``NOTE_EVERY_S`` while the driver
lives and targets each of them (pid plus start time) until it is gone. Other Ray instances on the machine
(a test session's cluster, a user's own ``ray start``) have other session directories and raylets. It runs in its
own session (``start_new_session``) and ignores SIGINT/SIGHUP/SIGTERM, so the Ctrl-C that stops the driver
does not stop its cleanup.

Usage (by ``preprocess.ray_runner``): ``python -I .../ray_watchdog.py SESSION_DIR [RAYLET_PID ...]``.
"""

from __future__ import annotations

import os
import select
import shutil
import signal
import subprocess
import sys
import time

__all__ = ["start_watchdog", "session_processes", "clean_session"]

# After SIGTERM, Ray's processes exit within ~1 s; give them 5 before SIGKILL.
TERM_GRACE_S = 5.0
NOTE_EVERY_S = 1.0


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return b""


def session_processes(session_dir: str, raylet_pids: list[int], live_raylets: list[int]) -> list[int]:
    """Pids of this user's processes that belong to the Ray instance of ``session_dir`` (``live_raylets``:
    those of ``raylet_pids`` still running as the same process, so a reused pid adopts nothing)."""
    name = os.path.basename(session_dir.rstrip("/")).encode()
    raylet_marks = {f"RAY_RAYLET_PID={pid}".encode() for pid in raylet_pids}
    mine = {os.getpid(), os.getppid()}
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in mine:
            continue
        cmdline = _read(f"/proc/{entry}/cmdline")
        if not cmdline:
            continue  # gone, a kernel thread, or not ours to read
        if name in cmdline or (live_raylets and _parent(int(entry)) in live_raylets):
            found.append(int(entry))
        elif cmdline.startswith(b"ray::") and raylet_marks:
            environ = set(_read(f"/proc/{entry}/environ").split(b"\0"))
            if environ & raylet_marks:
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


def _note(targets: dict[int, str], session_dir: str, raylets: dict[int, str]) -> list[int]:
    """Add this instance's processes to ``targets`` (pid -> start time); return those still alive."""
    for pid in session_processes(session_dir, list(raylets), _alive(raylets)):
        targets.setdefault(pid, _start_time(pid))
    return _alive(targets)


def clean_session(session_dir: str, raylets: dict[int, str], targets: dict[int, str] | None = None) -> None:
    """Stop every process of this Ray instance (SIGTERM, then SIGKILL) and remove its session directory.

    A process once seen as this instance's (``targets``: noted while the run was alive) stays a target
    until it is gone, even if it no longer looks like one by then (a Python process shutting down may
    restore its original command line; a raylet's pid dies with it)."""
    targets = {} if targets is None else targets

    def alive_targets() -> list[int]:
        return _note(targets, session_dir, raylets)

    pids = alive_targets()
    _signal_all(pids, signal.SIGTERM)
    deadline = time.monotonic() + TERM_GRACE_S
    while pids and time.monotonic() < deadline:
        time.sleep(0.1)
        pids = alive_targets()
    _signal_all(pids, signal.SIGKILL)
    shutil.rmtree(session_dir, ignore_errors=True)
    latest = os.path.join(os.path.dirname(session_dir.rstrip("/")), "session_latest")
    try:
        if os.path.islink(latest) and os.readlink(latest).rstrip("/") == session_dir.rstrip("/"):
            os.unlink(latest)  # it would dangle; a newer session re-creates it
    except OSError:
        pass


def start_watchdog(session_dir: str, raylet_pids: list[int]) -> subprocess.Popen:
    """Start the watchdog for the Ray instance this process just started; ``stdin.close()`` (or this
    process ending, any way) makes it clean up."""
    # Run as a script in isolated mode (-I): standard library only, so it starts in ~20 ms and needs
    # neither the package on sys.path nor anything from the environment.
    return subprocess.Popen(
        [sys.executable, "-I", os.path.abspath(__file__), session_dir, *map(str, raylet_pids)],
        stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        close_fds=True,
    )


def main(argv: list[str]) -> None:
    for signum in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)
    session_dir = argv[0]
    raylets = {int(pid): _start_time(int(pid)) for pid in argv[1:]}  # pid -> start time
    targets: dict[int, str] = {}
    stdin = sys.stdin.buffer.raw
    _note(targets, session_dir, raylets)  # the agents are up by now: ray.init has returned
    while True:
        # The driver never writes: readable means EOF (it has ended, or let go). Meanwhile note the
        # instance's processes every NOTE_EVERY_S (~1 ms of /proc reads for 130 processes).
        readable, _, _ = select.select([stdin], [], [], NOTE_EVERY_S)
        if readable and not stdin.read(4096):
            break
        _note(targets, session_dir, raylets)
    clean_session(session_dir, raylets, targets)


if __name__ == "__main__":
    main(sys.argv[1:])
