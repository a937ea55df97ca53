"""Cleans up a local Ray instance after the run that started it, however that run ends.

``preprocess run`` without ``--ray-address`` starts its own Ray (GCS, raylet, agents, workers) and a session
directory under ``/tmp/ray``. ``ray.shutdown()`` stops most of that on a normal exit, but leaves the
session directory (39 MB over 201 runs in a day of testing), and a SIGKILLed driver runs no code at all:
its raylet's agents then live on ~60 s until they notice. So the driver starts this tiny process next to
the Ray it started, holding the write end of a pipe to its stdin: when the driver ends (normally, by
``os._exit`` on a second Ctrl-C, or SIGKILL), the kernel closes that pipe, the read here returns EOF, and
this process kills what is left of *that* Ray and removes *its* session directory.

Only what the run started is touched: a process is this Ray's when its command line names this session
directory (GCS, raylet, monitors), or when it is a ``ray::`` process whose environment names this
session's raylet (``RAY_RAYLET_PID``: agents, workers); other Ray instances on the machine (a test
session's cluster, a user's own ``ray start``) have other session directories and raylets. It runs in its
own session (``start_new_session``) and ignores SIGINT/SIGHUP/SIGTERM, so the Ctrl-C that stops the driver
does not stop its cleanup.

Usage (by ``preprocess.ray_runner``): ``python -m preprocess.ray_watchdog SESSION_DIR [RAYLET_PID ...]``.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

__all__ = ["start_watchdog", "session_processes", "clean_session"]

# After SIGTERM, Ray's processes exit within ~1 s; give them 5 before SIGKILL.
TERM_GRACE_S = 5.0


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return b""


def session_processes(session_dir: str, raylet_pids: list[int]) -> list[int]:
    """Pids of this user's processes that belong to the Ray instance of ``session_dir``."""
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
        if name in cmdline:
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


def clean_session(session_dir: str, raylet_pids: list[int]) -> None:
    """Stop every process of this Ray instance (SIGTERM, then SIGKILL) and remove its session directory."""
    pids = session_processes(session_dir, raylet_pids)
    _signal_all(pids, signal.SIGTERM)
    deadline = time.monotonic() + TERM_GRACE_S
    while pids and time.monotonic() < deadline:
        time.sleep(0.1)
        pids = session_processes(session_dir, raylet_pids)
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
    return subprocess.Popen(
        [sys.executable, "-m", "preprocess.ray_watchdog", session_dir, *map(str, raylet_pids)],
        stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        close_fds=True,
    )


def main(argv: list[str]) -> None:
    for signum in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)
    session_dir, raylet_pids = argv[0], [int(p) for p in argv[1:]]
    while sys.stdin.buffer.read(4096):
        pass  # the driver never writes: this returns b"" (EOF) when the driver has ended or let go
    clean_session(session_dir, raylet_pids)


if __name__ == "__main__":
    main(sys.argv[1:])
