"""Ctrl-C / SIGTERM during a run: the first stops it cleanly, a second at once; data always consistent.

Runs are ``preprocess run`` subprocesses joining the session's Ray cluster (``--ray-address``); each is
signalled once its log shows work under way (polled, never a fixed sleep).
"""

from __future__ import annotations

import fcntl
import json
import os
import signal

import pytest

import shardio
from tests.interrupt_helpers import (
    SAMPLES_PER_TAR, config_file, has_event, log_events, slow_inputs, start, wait_until,
)
from tests.legacy_format import legacy_doc

pytestmark = pytest.mark.ray
INPUTS = 30


def _assert_consistent(out: str, report: dict | None) -> dict:
    """The committed dataset verifies, and holds exactly the inputs the report says were processed."""
    ds = shardio.open_dataset(out, verify=True)
    manifest = legacy_doc(out)
    assert len(ds) == SAMPLES_PER_TAR * len(manifest["inputs"])
    assert all(entry["samples"] == SAMPLES_PER_TAR for entry in manifest["inputs"].values())
    if report is not None:
        assert sorted(manifest["inputs"]) == sorted(report["inputs_processed"])
    return manifest


@pytest.mark.parametrize("signum, exit_code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_first_signal_stops_scheduling_commits_what_finished_and_writes_the_report(
    ray_cluster, tars, tmp_path, signum, exit_code
):
    inputs = slow_inputs(tars, INPUTS)
    out, log, report_path = str(tmp_path / "out"), str(tmp_path / "run.jsonl"), str(tmp_path / "report.json")
    stderr = str(tmp_path / "stderr.txt")
    run = start([f"{tars.directory}/*.tar", "--output", out, "--config", config_file(str(tmp_path)), "-q",
                 "--log-format", "json", "--log-file", log, "--report", report_path,
                 "--ray-address", ray_cluster], stderr)
    wait_until(lambda: has_event(log, "input_finished"), run, what="the first input finished")
    run.send_signal(signum)
    assert run.wait(timeout=120) == exit_code, open(stderr).read()

    report = json.load(open(report_path))
    name = signal.Signals(signum).name
    assert report["interrupted"] == name and report["exit_code"] == exit_code
    assert report["inputs_processed"], "the input that had finished before the signal was not committed"
    assert report["inputs_unfinished"], "the run was not stopped early"
    assert sorted(report["inputs_processed"] + report["inputs_unfinished"]) == sorted(inputs)
    assert not report["inputs_failed"], "cancelled inputs must be unfinished, not failed"
    _assert_consistent(out, report)
    # The run's own copy of the report, and it said so: on stderr (even with -q) and in the log.
    assert os.path.exists(os.path.join(out, "reports", f"{report['run_id']}.json"))
    assert f"{name}: stopping" in open(stderr).read()
    finished = [r for r in log_events(log) if r["event"] == "run_finished"]
    assert finished and finished[0]["interrupted"] == name and finished[0]["exit_code"] == exit_code

    # Stopped early, the run keeps its mark: a cancelled task may still promote a file the next run removes.
    assert os.path.exists(os.path.join(out, f".run-{report['run_id']}.json"))
    if signum == signal.SIGTERM:
        return
    # The next run does the rest: the dataset ends complete.
    rerun = start([f"{tars.directory}/*.tar", "--output", out, "--config", config_file(str(tmp_path)), "-q",
                   "--ray-address", ray_cluster], str(tmp_path / "stderr2.txt"))
    assert rerun.wait(timeout=300) == 0
    assert len(_assert_consistent(out, None)["inputs"]) == INPUTS
    assert not [n for n in os.listdir(out) if n.startswith(".run-")]


def _catches(pid: int, signum: int) -> bool:
    """Whether process ``pid`` has a handler for ``signum`` (``SigCgt`` in /proc/PID/status)."""
    with open(f"/proc/{pid}/status") as f:
        caught = next(line for line in f if line.startswith("SigCgt:")).split()[1]
    return bool(int(caught, 16) >> (signum - 1) & 1)


def test_a_second_signal_exits_at_once(ray_cluster, tars, tmp_path):
    # The run waits (--wait) for the output lock this test holds, so it cannot finish between the two
    # signals: the second one is what ends it. (A first signal does not end a wait for the lock.)
    tars.make("a.tar", range(3))
    out, stderr = tmp_path / "out", str(tmp_path / "stderr.txt")
    out.mkdir()
    holder = os.open(out / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(holder, fcntl.LOCK_EX)
    try:
        run = start([tars.made[0], "--output", str(out), "--size", "16", "--wait", "-q",
                     "--ray-address", ray_cluster], stderr)
        # Python catches SIGINT from the start; SIGTERM only once the run's handler is installed.
        wait_until(lambda: _catches(run.pid, signal.SIGTERM), run, what="the signal handlers")
        run.send_signal(signal.SIGTERM)
        wait_until(lambda: "SIGTERM: stopping" in open(stderr).read(), run, what="the first signal's notice")
        run.send_signal(signal.SIGINT)
        assert run.wait(timeout=60) == 130
    finally:
        os.close(holder)
    assert "second signal (SIGINT): exiting now" in open(stderr).read()
    assert not os.path.exists(out / "reports"), "the second signal did not exit at once"
