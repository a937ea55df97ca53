"""A decode that never returns stops neither the job nor its rerun (issue 22 B; ``preprocess.image.decode_watch``).

The hang is the documented test-only hook: ``PREPROCESS_TEST_HANG_MEMBERS`` in a worker's environment makes
the decode of a matching member block forever, as the libjpeg bug did (in ``monkeypatch``'s environment
here; in the Ray workers' through the tasks' ``runtime_env``). Members ``stuck-*.jpg`` hang; the others are
self-identifying good samples.
"""

from __future__ import annotations

import os

import pytest

import shardio

from preprocess.cluster import ray_tasks
from preprocess.config import JobConfig
from preprocess.image.decode_watch import (HANG_MEMBERS_ENV, Heartbeat, StuckDecode, hard_bound_s, release_test_hangs,
                                     stuck_reason, watch_steps)
from preprocess.job import RunOptions, run_job
from preprocess.worker import iter_process_input, process_input
from shardio.failure_reasons import failure_category
from tests.tar_factory import decode_index, read_shards

# 0.5 s: a 320x240 test JPEG decodes in ~2 ms, and the hard bound is then 2 s.
CFG = JobConfig(height=16, width=16, samples_per_shard=4, max_decode_seconds=0.5)
HANG = "stuck-*.jpg"


@pytest.fixture
def hanging_tar(tars):
    """Samples 0..9 with two that never decode (stuck-000003, stuck-000007) among them."""
    members = (tars.samples(range(0, 3)) + tars.samples([3], prefix="stuck-") + tars.samples(range(4, 7))
               + tars.samples([7], prefix="stuck-") + tars.samples(range(8, 10)))
    return tars.write("hanging.tar", members)


@pytest.fixture
def hang_in_this_process(monkeypatch):
    monkeypatch.setenv(HANG_MEMBERS_ENV, HANG)
    yield
    release_test_hangs()  # the stuck decode thread ends with the test


def fingerprint(path: str) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_size, st.st_mtime_ns


# --- the worker, without Ray -----------------------------------------------------------------------------


def test_heartbeat_names_only_a_decode_older_than_the_bound():
    heartbeat = Heartbeat()
    assert heartbeat.stuck(0.0) is None, "no decode running: nothing is stuck"
    heartbeat.begin("000001", "000001.jpg")
    stuck = heartbeat.stuck(-1.0)
    assert stuck is not None and (stuck.key, stuck.member) == ("000001", "000001.jpg")
    assert heartbeat.stuck(3600.0) is None
    heartbeat.end()
    assert heartbeat.stuck(-1.0) is None


def test_the_hard_bound_is_twice_the_limit_plus_a_second():
    assert hard_bound_s(30.0) == 61.0 and hard_bound_s(0.5) == 2.0


def test_watching_a_healthy_tar_changes_nothing(tars, tmp_path):
    tar = tars.make("a.tar", range(10))
    plain = process_input(tar, str(tmp_path / "plain"), CFG, fingerprint(tar))
    heartbeat = Heartbeat()
    steps = watch_steps(iter_process_input(tar, str(tmp_path / "watched"), CFG, fingerprint(tar),
                                           heartbeat=heartbeat), heartbeat, hard_bound_s(CFG.max_decode_seconds))
    messages = []
    while True:
        try:
            messages.append(next(steps))
        except StopIteration as stop:
            watched = stop.value
            break
    assert not any(isinstance(m, StuckDecode) for m in messages)
    assert watched.samples == plain.samples == 10 and watched.failures == []
    assert [s["checksum"] for s in watched.shards] == [s["checksum"] for s in plain.shards]


def test_a_worker_error_reaches_the_watching_thread(tmp_path):
    def failing():
        yield 1, 0
        raise OSError(28, "No space left on device")

    steps = watch_steps(failing(), Heartbeat(), 2.0)
    assert next(steps) == (1, 0)
    with pytest.raises(OSError, match="No space left"):
        next(steps)


def test_a_decode_that_never_returns_is_reported_with_its_member(hanging_tar, tmp_path, hang_in_this_process):
    heartbeat = Heartbeat()
    bound = hard_bound_s(CFG.max_decode_seconds)
    steps = watch_steps(iter_process_input(hanging_tar, str(tmp_path / "out"), CFG, fingerprint(hanging_tar),
                                           heartbeat=heartbeat), heartbeat, bound)
    stuck = [m for m in steps if isinstance(m, StuckDecode)]  # ends after the first stuck decode
    assert len(stuck) == 1
    assert (stuck[0].key, stuck[0].member) == ("stuck-000003", "stuck-000003.jpg")
    assert stuck[0].seconds >= bound  # reported once past the bound (rounded to ms: 2.0004 says 2.0)


def test_skipped_members_are_failed_samples_and_the_rest_is_written(hanging_tar, tmp_path, hang_in_this_process):
    out = str(tmp_path / "out")
    result = process_input(hanging_tar, out, CFG, fingerprint(hanging_tar),
                           skip_members=("stuck-000003.jpg", "stuck-000007.jpg"))
    assert result.error is None and result.samples == 8
    assert [(f["key"], f["reason"]) for f in result.failures] == [
        ("stuck-000003", stuck_reason("stuck-000003.jpg", 2.0)),
        ("stuck-000007", stuck_reason("stuck-000007.jpg", 2.0)),
    ]
    assert "stuck-000003.jpg: decode did not finish within 2 s" in result.failures[0]["reason"]
    assert [f["code"] for f in result.failures] == ["decode_stuck", "decode_stuck"]
    assert failure_category(result.failures[0]) == "decode did not finish (worker stopped, sample skipped)"
    pixels, rows = read_shards(out, result.shards)
    assert [decode_index(p) for p in pixels] == [0, 1, 2, 4, 5, 6, 8, 9]
    assert [r["key"] for r in rows] == [f"{i:06d}" for i in (0, 1, 2, 4, 5, 6, 8, 9)]


# --- through the Ray job -------------------------------------------------------------------------------------


@pytest.fixture
def hang_in_ray_workers(monkeypatch):
    """The job's tasks run with the hook set (a runtime_env gets its own Ray workers, so no other test's)."""
    monkeypatch.setitem(ray_tasks.TASK_OPTIONS, "runtime_env", {"env_vars": {HANG_MEMBERS_ENV: HANG}})


@pytest.mark.ray
def test_a_stuck_decode_fails_its_sample_the_tar_commits_and_a_rerun_skips_it(
        ray_cluster, tars, hanging_tar, tmp_path, hang_in_ray_workers):
    healthy = tars.make("healthy.tar", range(20, 25))
    out = str(tmp_path / "out")
    options = RunOptions(inputs=[hanging_tar, healthy], output=out, config=CFG)
    report = run_job(options)
    assert report.inputs_failed == [] and sorted(report.inputs_processed) == sorted([hanging_tar, healthy])
    assert report.samples_written == 13 and report.samples_failed == 2
    assert {(f["input"], f["key"]): f["reason"] for f in report.failures} == {
        (hanging_tar, "stuck-000003"): stuck_reason("stuck-000003.jpg", 2.0),
        (hanging_tar, "stuck-000007"): stuck_reason("stuck-000007.jpg", 2.0)}
    assert [f["code"] for f in report.failures] == ["decode_stuck", "decode_stuck"]  # through Ray
    assert sum("did not finish" in w for w in report.warnings) == 2, report.warnings
    assert report.exit_code == 0
    ds = shardio.open_dataset(out, verify=True)
    indices = [decode_index(p) for i in range(len(ds.shards)) for p in ds.pixels(i)]
    assert sorted(indices) == [0, 1, 2, 4, 5, 6, 8, 9, 20, 21, 22, 23, 24]

    again = run_job(options)  # would hang (and be stopped) again if the input were processed again
    assert sorted(again.inputs_skipped) == sorted([hanging_tar, healthy]) and again.inputs_processed == []
    assert again.warnings == []


@pytest.mark.ray
def test_an_input_whose_decodes_keep_sticking_fails_after_bounded_restarts(
        ray_cluster, hanging_tar, tmp_path, hang_in_ray_workers, monkeypatch):
    monkeypatch.setattr(ray_tasks, "MAX_STUCK_DECODES", 1)
    report = run_job(RunOptions(inputs=[hanging_tar], output=str(tmp_path / "out"), config=CFG))
    assert report.inputs_processed == [] and report.exit_code == 1
    [failed] = report.inputs_failed
    assert failed["input"] == hanging_tar
    assert failed["reason"].startswith("2 decodes did not finish within 2 s (stuck-000003.jpg, stuck-000007.jpg)")
    assert report.dataset_samples == 0
