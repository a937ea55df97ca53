"""A run that starts its own local Ray (no --ray-address): what it prints and what it leaves behind.

Subprocess runs (~5 s each of Ray start-up), one per way a run ends: a SIGINT during Ray's start-up
(acted on after it: exit 130 with a report, never a segfault), with ``--log-format json`` on stderr, where
every line must be JSON, Ray's own included; a SIGKILL mid-run under ``-q``, which must print nothing; and
a SIGKILL inside ``ray.init``, its raylet started (Ray's start-up, before it returns).
Every way the Ray processes the run started and their session directory must go, while the session's
own cluster (another Ray instance on this machine) is left alone.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
import ray

import shardio
from shardio.store.backends import for_path
from tests.interrupt_helpers import config_file, session_dirs_of, slow_inputs, start, wait_until

pytestmark = pytest.mark.ray


def _ray_processes_of(run_pid: int) -> list[psutil.Process]:
    return psutil.Process(run_pid).children(recursive=True)


def _assert_gone(processes: list[psutil.Process], session_dirs: list[str], timeout_s: float = 60.0) -> None:
    """Everything the run's Ray started is gone, promptly (polled; Ray's own agents took ~60 s)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        alive = [p for p in processes if _alive(p)]
        left = [d for d in session_dirs if os.path.exists(d)]
        if not alive and not left:
            return
        time.sleep(0.05)
    raise AssertionError(f"left behind: processes {[(p.pid, p.name()) for p in alive]}, "
                         f"session dirs {left}")


def _test_cluster_nodes() -> int:
    return len([node for node in ray.nodes() if node["Alive"]]) if ray.is_initialized() else 0


def _alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_sigint_during_ray_start_up_then_clean_exit_with_json_only_stderr(ray_cluster, tars, tmp_path):
    tars.make("a.tar", range(3))
    out, stderr, report_path = str(tmp_path / "out"), str(tmp_path / "stderr.txt"), str(tmp_path / "r.json")
    run = start([tars.made[0], "--output", out, "--size", "16", "--workers", "1", "--log-format", "json",
                 "--report", report_path], stderr, local_ray=True)
    # The lock is taken just before Ray starts; its session directory appears as ray.init begins.
    wait_until(lambda: session_dirs_of(run.pid), run, what="Ray's start-up")
    processes = _ray_processes_of(run.pid)
    session_dirs = session_dirs_of(run.pid)
    run.send_signal(signal.SIGINT)
    assert run.wait(timeout=120) == 130, open(stderr, "rb").read()[-2000:]

    lines = open(stderr, encoding="utf-8").read().splitlines()
    records = [json.loads(line) for line in lines]  # every line on stderr is JSON (Ray's own lines too)
    events = [r["event"] for r in records]
    assert "signal" in events and events[-1] == "run_finished", events
    assert records[-1]["interrupted"] == "SIGINT" and records[-1]["exit_code"] == 130
    report = json.load(open(report_path))
    assert report["interrupted"] == "SIGINT" and report["inputs_processed"] == []
    assert report["inputs_unfinished"] == [tars.made[0]]
    assert len(shardio.open_dataset(out)) == 0  # nothing half-done; the next run does it all

    _assert_gone(processes, session_dirs)
    assert _test_cluster_nodes() == 2, "touched the test cluster"


def test_a_sigkilled_quiet_run_leaves_no_ray_processes_or_session_dir(ray_cluster, tars, tmp_path):
    slow_inputs(tars, 6)
    out, stderr = str(tmp_path / "out"), str(tmp_path / "stderr.txt")
    run = start([f"{tars.directory}/*.tar", "--output", out, "--config", config_file(str(tmp_path)),
                 "--workers", "1", "-q"], stderr, local_ray=True)
    shards = os.path.join(out, "shards")
    wait_until(lambda: for_path(shards).list_dir(shards), run, what="the first shard file")
    processes = _ray_processes_of(run.pid)
    session_dirs = session_dirs_of(run.pid)
    assert session_dirs and any("raylet" in " ".join(p.cmdline()) for p in processes)
    run.send_signal(signal.SIGKILL)
    run.wait(timeout=30)

    assert open(stderr, "rb").read() == b"", "-q printed something (Ray's start-up warnings?)"
    _assert_gone(processes, session_dirs)  # the watchdog included: it ends once it has cleaned up
    assert _test_cluster_nodes() == 2, "touched the test cluster"


# The run, held inside ray.init once its raylet has started (GCS and raylet up, agents starting, ray.init not
# returned): a point of Ray's start-up reached by the run itself, not by waiting a guessed time.
HELD_IN_RAY_START_UP = """
import sys
import threading

import ray._private.node as node

real_start_raylet = node.Node.start_raylet


def start_raylet(self, *args, **kwargs):
    real_start_raylet(self, *args, **kwargs)
    open(sys.argv[1], "w").close()
    threading.Event().wait()  # held here until killed


node.Node.start_raylet = start_raylet
from preprocess.cli import app

app(sys.argv[2:], prog_name="preprocess")
"""


def _mentioning(session_dirs: list[str]) -> list[psutil.Process]:
    """Processes whose command line names one of these session directories (GCS, raylet, monitors)."""
    names = [os.path.basename(d) for d in session_dirs]
    found = []
    for process in psutil.process_iter():
        try:
            if any(name in " ".join(process.cmdline()) for name in names):
                found.append(process)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def test_a_run_sigkilled_during_ray_start_up_leaves_no_ray_processes_or_session_dir(ray_cluster, tars,
                                                                                    tmp_path):
    tars.make("a.tar", range(3))
    held = tmp_path / "held"
    env = {name: value for name, value in os.environ.items() if name != "RAY_ADDRESS"}  # its own local Ray
    args = ["run", tars.made[0], "--output", str(tmp_path / "out"), "--size", "16", "--workers", "1", "-q"]
    run = subprocess.Popen([sys.executable, "-c", HELD_IN_RAY_START_UP, str(held), *args],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    try:
        wait_until(held.exists, run, what="the raylet's start inside ray.init")
        processes = _ray_processes_of(run.pid)  # only this run's: its children, theirs in turn
        session_dirs = session_dirs_of(run.pid)
        assert session_dirs and any("raylet" in " ".join(p.cmdline()) for p in processes)
        run.send_signal(signal.SIGKILL)
        run.wait(timeout=30)
        # Within 30 s (SIGTERM, SIGKILL 5 s later), not Ray's own ~60 s; the watchdog included.
        _assert_gone(processes, session_dirs, timeout_s=30)
        assert not _mentioning(session_dirs), "a process of the killed run's Ray lives on"
    finally:
        if run.poll() is None:
            run.kill()
    assert _test_cluster_nodes() == 2, "touched the test cluster"


def test_a_local_run_prints_no_ray_token_warning_and_keeps_token_auth(ray_cluster, tars, tmp_path, monkeypatch):
    """Ray's "Token authentication is enabled ... Set RAY_AUTH_MODE=disabled to opt out" (4 lines on every
    run) is gone because the run asks for token mode explicitly, not because authentication is off."""
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)  # as on a user's machine: start() copies os.environ
    tars.make("a.tar", range(3))
    out, stderr = str(tmp_path / "out"), str(tmp_path / "stderr.txt")
    run = start([tars.made[0], "--output", out, "--size", "16", "--workers", "1"], stderr, local_ray=True)
    assert run.wait(timeout=300) == 0, open(stderr, "rb").read()[-2000:]
    said = open(stderr, encoding="utf-8").read()
    assert "Token authentication" not in said and "RAY_AUTH_MODE" not in said, said
    assert "1 input(s) to process" in said, "not a run that printed its progress"
    assert len(shardio.open_dataset(out)) == 3
