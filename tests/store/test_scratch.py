"""The local scratch folder (``shardio.store.scratch``): one parent per user, one locked folder per process,
and only the folders of processes that are gone are ever removed."""

from __future__ import annotations

import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile

import pytest

from shardio.store import scratch
from tests.other_user import NOBODY, as_nobody, needs_root


@pytest.fixture
def base(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDIO_SCRATCH", str(tmp_path))
    monkeypatch.setattr(scratch, "_SCRATCH", None)
    return tmp_path


def _fresh_call(monkeypatch) -> str:
    """scratch_dir() as a new process's first call would run it (the sweep included)."""
    monkeypatch.setattr(scratch, "_SCRATCH", None)
    return scratch.scratch_dir()


def _child_holding_scratch(env_base) -> tuple[subprocess.Popen, str]:
    code = ("import sys; from shardio.store.scratch import scratch_dir; print(scratch_dir(), flush=True); "
            "sys.stdin.read()")
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True, env={**os.environ, "SHARDIO_SCRATCH": str(env_base)})
    return child, child.stdout.readline().strip()


def test_each_user_gets_a_private_parent_and_each_process_its_own_folder(base):
    path = scratch.scratch_dir()
    parent = base / f"shardio-scratch-{os.getuid()}"
    assert os.path.dirname(path) == str(parent)
    assert stat.S_IMODE(os.stat(parent).st_mode) == 0o700
    assert os.path.basename(path).startswith(f"{os.getpid()}-")
    assert scratch.scratch_dir() == path  # one folder for the life of the process
    child, child_path = _child_holding_scratch(base)
    try:
        assert child_path != path and os.path.dirname(child_path) == str(parent)
    finally:
        child.kill()
        child.wait()


def test_a_gone_process_folder_is_removed_a_running_one_kept(base, monkeypatch):
    live, live_path = _child_holding_scratch(base)
    killed, killed_path = _child_holding_scratch(base)
    for folder in (live_path, killed_path):
        with open(os.path.join(folder, ".tmp-s.npy.1"), "wb") as f:
            f.write(b"staged")
    killed.send_signal(signal.SIGKILL)  # a SIGKILLed worker cannot clean up: its lock dies with it
    killed.wait()
    parent = os.path.dirname(live_path)
    os.mkdir(os.path.join(parent, "notes"))  # no .owner: not a scratch folder, not ours to judge
    try:
        mine = _fresh_call(monkeypatch)
        assert sorted(os.listdir(parent)) == sorted(os.path.basename(p) for p in (live_path, mine, "notes"))
        assert os.path.exists(os.path.join(live_path, ".tmp-s.npy.1"))
    finally:
        live.kill()
        live.wait()
    _fresh_call(monkeypatch)
    assert not os.path.exists(live_path)  # gone once its process is


def test_a_pid_that_looks_dead_does_not_make_a_folder_removable(base, monkeypatch):
    """A process of another container sharing the temp dir has a PID that means nothing here: only the
    lock decides. The folder below is named after a dead PID, but its lock is held."""
    parent = base / f"shardio-scratch-{os.getuid()}"
    parent.mkdir(mode=0o700)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True).stdout.strip()
    folder = parent / f"{dead}-other-namespace"
    folder.mkdir()
    import fcntl

    fd = os.open(folder / scratch.OWNER_FILE, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)  # another file description: flock conflicts even within one process
    try:
        _fresh_call(monkeypatch)
        assert folder.exists()
    finally:
        os.close(fd)


def test_a_filesystem_without_flock_still_gets_scratch_but_sweeps_nothing(base, monkeypatch):
    import errno
    import fcntl

    killed, killed_path = _child_holding_scratch(base)
    killed.send_signal(signal.SIGKILL)
    killed.wait()

    def no_locks(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    mine = _fresh_call(monkeypatch)
    assert os.path.isdir(mine)
    assert os.path.isdir(killed_path)  # gone, most likely, but nothing here can prove it


@needs_root
def test_a_second_user_runs_beside_the_first_on_one_machine(monkeypatch):
    """The first user's parent folder never blocks another user (it once was a shared 0755 folder)."""
    shared = tempfile.mkdtemp(prefix="shardio-shared-tmp-", dir="/tmp")
    os.chmod(shared, 0o1777)  # like /tmp
    try:
        monkeypatch.setenv("SHARDIO_SCRATCH", shared)
        mine = _fresh_call(monkeypatch)

        def stage_a_file() -> str:
            scratch._SCRATCH = None
            theirs = scratch.scratch_dir()
            open(os.path.join(theirs, "staged"), "wb").close()
            return theirs

        theirs = as_nobody(stage_a_file)
        assert isinstance(theirs, str), theirs
        assert os.path.dirname(theirs) == os.path.join(shared, f"shardio-scratch-{NOBODY}")
        assert os.stat(os.path.dirname(theirs)).st_uid == NOBODY
        assert os.path.dirname(mine) == os.path.join(shared, f"shardio-scratch-{os.getuid()}")
    finally:
        shutil.rmtree(shared, ignore_errors=True)


@needs_root
def test_a_parent_owned_by_someone_else_is_refused_with_its_path(base, monkeypatch):
    parent = base / f"shardio-scratch-{os.getuid()}"
    parent.mkdir(mode=0o777)
    os.chown(parent, NOBODY, NOBODY)  # planted by another user: our staged pixels would be theirs to read
    with pytest.raises(PermissionError, match=rf"{parent}: scratch folder owned by uid {NOBODY}.*SHARDIO_SCRATCH"):
        _fresh_call(monkeypatch)
