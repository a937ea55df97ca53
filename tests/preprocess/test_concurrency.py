"""Two runs on one output (a cron overlap): the second exits at once, or queues with --wait; a run killed
with SIGKILL never leaves the lock stuck. No Ray: the lock is taken before any work."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

from typer.testing import CliRunner

from preprocess.cli import app
from preprocess.config import JobConfig
from shardio.store.backends import for_path
from shardio.write.directory import writing
from shardio.errors import OutputLocked
from shardio.format import InputEntry, Manifest
from shardio.write.shard_writer import write_manifest

runner = CliRunner()


def committed_dataset(tars, out: str) -> str:
    """A dataset whose one input is already committed (no shards): a run over it has nothing to do."""
    tar = tars.make("a.tar", range(1))
    size, mtime_ns = for_path(tar).stat_fingerprint(tar)
    os.makedirs(out, exist_ok=True)
    manifest = Manifest(shape=(16, 16, 3), config=JobConfig(height=16, width=16).output_dict(), versions={},
                        inputs={tar: InputEntry(size=size, mtime_ns=mtime_ns, samples=0, failed=0)})
    write_manifest(out, manifest)
    return tar


def run_cli(tar: str, out: str, *flags: str):
    return runner.invoke(app, ["run", tar, "--output", out, "--size", "16", *flags])


def test_a_second_run_exits_at_once_naming_the_holder(tars, tmp_path):
    out = str(tmp_path / "out")
    tar = committed_dataset(tars, out)
    with writing(out):
        started = time.perf_counter()
        result = run_cli(tar, out)
        assert time.perf_counter() - started < 5
    assert result.exit_code == 2, result.output
    message = " ".join(result.output.split())  # rich wraps long paths
    assert "another run is writing" in message and f"pid {os.getpid()}" in message and "--wait" in message
    assert run_cli(tar, out, "-q").exit_code == 0  # once the holder is gone


def test_wait_queues_behind_the_running_one(tars, tmp_path):
    out = str(tmp_path / "out")
    tar = committed_dataset(tars, out)
    lock = writing(out)
    lock.__enter__()
    threading.Timer(1.0, lock.__exit__, args=(None, None, None)).start()
    started = time.perf_counter()
    result = run_cli(tar, out, "--wait")
    assert result.exit_code == 0, result.output
    assert time.perf_counter() - started >= 0.9
    assert "nothing new to process" in result.output


def test_a_run_killed_with_sigkill_does_not_leave_the_lock_stuck(tmp_path):
    out = str(tmp_path / "out")
    os.makedirs(out)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from shardio.write.directory import writing\n"
         "with writing(sys.argv[1]):\n    print('held', flush=True); time.sleep(60)", out],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        try:
            with writing(out):
                raise AssertionError("the lock was taken while a live run holds it")
        except OutputLocked as e:
            assert f"pid {holder.pid}" in str(e)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    with writing(out):  # the kernel dropped the dead run's flock: no stale lock file to clear
        pass
