"""Killed runs, killed workers and full disks never leave a wrong, duplicated or half-visible dataset.

The kill loop runs the CLI as subprocesses that join the session's Ray cluster (no Ray start-up per
run), SIGKILLs them at random moments over the length of an uninterrupted run, checks that what is
visible in between is always a valid dataset, and finally compares the finished result with that
uninterrupted run byte for byte (a bucketed run too, its shards' buckets the uninterrupted run's). Worker deaths
and full disks are simulated inside the Ray task by swapping ``ray_tasks._task`` for a wrapper (cloudpickle ships
the local function by value).
"""

from __future__ import annotations

import errno
import json
import os
import random
import signal
import subprocess
import sys
import time

import psutil
import pytest
from typer.testing import CliRunner

import shardio
from preprocess.cluster import ray_tasks
from preprocess.cli import app
from shardio.store.backends import for_path
from shardio.store.local import LocalStorage, atomic_writer
from tests.dataset_compare import assert_clean, assert_indices, assert_same_dataset, decoded_indices
from tests.bucket_jobs import BUCKET_FLAGS, check_buckets, make_bucket_tars

pytestmark = pytest.mark.ray
runner = CliRunner()
FLAGS = ["--size", "32", "--samples-per-shard", "8"]
KILLS = 5


def start_run(pattern: str, out: str, address: str, log: str, extra: tuple[str, ...] = ()) -> subprocess.Popen:
    with open(log, "ab") as stderr:
        return subprocess.Popen([sys.executable, "-m", "preprocess.cli", "run", pattern, "--output", out, *FLAGS,
                                 *extra, "-q", "--ray-address", address], stdout=subprocess.DEVNULL, stderr=stderr)


def watch(run: subprocess.Popen, out: str, kill_at: tuple[str, float] | None = None) -> tuple[float, float]:
    """Poll a run every 5 ms; returns (seconds until its first shard file appeared, seconds until it ended).
    ``kill_at=("start", s)`` SIGKILLs it s seconds after it started, ``("write", s)`` s seconds after its
    first shard file appeared (mid-processing, mid-commit)."""
    began, first_write = time.perf_counter(), None
    shards = os.path.join(out, "shards")
    while run.poll() is None:
        now = time.perf_counter() - began
        if first_write is None and for_path(shards).list_dir(shards):
            first_write = now
        if kill_at is not None:
            phase, delay = kill_at
            origin = 0.0 if phase == "start" else first_write
            if origin is not None and now >= origin + delay:
                run.send_signal(signal.SIGKILL)
                run.wait()
                break
        time.sleep(0.005)
    return (first_write or 0.0), time.perf_counter() - began


def run_cli(*args: str, extra: tuple[str, ...] = ()):
    return runner.invoke(app, ["run", *args, *FLAGS, *extra, "-q"], catch_exceptions=False)


def wait_for_dead_runs_tasks(timeout_s: float = 20.0) -> None:
    """A SIGKILLed driver's tasks on the shared cluster run on until Ray notices (about a second). They can
    only leave unlisted files, which the next run removes at its start; wait them out so the clean-state
    assertions below are not racing them."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        titles = []
        for process in psutil.process_iter(["cmdline"]):
            titles += (process.info["cmdline"] or [""])[:1]
        if not any(title.startswith("ray::_task") for title in titles):
            return
        time.sleep(0.05)


def kill_while_writing_then_rerun(start, rerun, reference: str, directory, seed: int, write_s: float,
                                  attempts: int = 2) -> list[str]:
    """``attempts`` times, on a fresh output: the run ``start(out)`` starts is SIGKILLed at a random moment of
    its ``write_s`` seconds after its first shard file appeared (mid-write, mid-commit), its tasks waited out,
    then ``rerun(out)`` (a CliRunner result) must exit 0 and give ``reference`` byte for byte, nothing left
    behind. Returns the outputs, for a caller's own checks."""
    rng, outs = random.Random(seed), []
    for attempt in range(attempts):
        out = str(directory / f"out{attempt}")
        watch(start(out), out, ("write", rng.uniform(0.0, write_s)))
        wait_for_dead_runs_tasks()
        result = rerun(out)
        assert result.exit_code == 0, result.output
        assert_same_dataset(out, reference)
        assert_clean(out)
        outs.append(out)
    return outs


@pytest.mark.slow
@pytest.mark.parametrize("encoding", ["raw", "jpeg"])
def test_sigkill_at_random_moments_then_rerun_gives_the_uninterrupted_dataset(ray_cluster, tars, tmp_path, encoding):
    extra = ("--encoding", encoding)
    sizes = [90, 45, 73, 17, 80, 9]
    start = 0
    for number, size in enumerate(sizes):
        tars.make(f"{number:02d}.tar", range(start, start + size))
        start += size
    pattern, log = f"{tars.directory}/*.tar", str(tmp_path / "runs.log")
    reference = str(tmp_path / "reference")
    run = start_run(pattern, reference, ray_cluster, log, extra)
    startup_s, whole_s = watch(run, reference)
    assert run.returncode == 0, open(log).read()
    with open(os.path.join(reference, "manifest.json"), encoding="utf-8") as f:
        assert json.load(f)["config"].get("encoding", "raw") == encoding

    rng = random.Random(20240607)
    phases = []
    for attempt in range(KILLS):
        # Each kill on a fresh output: the first during start-up (lock, clean, Ray), the rest at random
        # moments while shards are written and the manifest committed. Then a rerun must finish the job.
        out = str(tmp_path / f"out{attempt}")
        kill_at = ("start", rng.uniform(0.0, startup_s)) if attempt == 0 else \
            ("write", rng.uniform(0.0, whole_s - startup_s))
        run = start_run(pattern, out, ray_cluster, log, extra)
        watch(run, out, kill_at)
        wait_for_dead_runs_tasks()
        visible = 0
        if for_path(out).exists(os.path.join(out, "manifest.json")):
            # Whatever a kill left visible is a valid dataset: checksums match, no sample twice.
            indices = decoded_indices(out)
            assert len(indices) == len(set(indices)) and set(indices) <= set(range(start))
            visible = len(indices)
        phases.append((kill_at[0], round(kill_at[1], 2), run.returncode, visible))
        # The rerun in-process (the session's Ray): the subprocess only needs to be the one killed.
        assert run_cli(pattern, "--output", out, extra=extra).exit_code == 0
        assert_same_dataset(out, reference)
        assert_clean(out)
        assert_indices(out, list(range(start)))
    print("kills (phase, s, exit, samples visible):", phases)


@pytest.mark.parametrize("encoding", ["raw", "jpeg"])
def test_a_worker_killed_mid_task_is_retried_without_duplicates(ray_cluster, tars, tmp_path, monkeypatch, encoding):
    extra = ("--encoding", encoding)
    tars.make("big.tar", range(0, 100))
    tars.make("small.tar", range(100, 105))
    pattern, reference, out = f"{tars.directory}/*.tar", str(tmp_path / "reference"), str(tmp_path / "out")
    assert run_cli(pattern, "--output", reference, extra=extra).exit_code == 0

    real_task, marker = ray_tasks._task, str(tmp_path / "died-once")

    def task_whose_worker_dies_once(input_path, output_dir, cfg_dict, fingerprint):
        for number, message in enumerate(real_task(input_path, output_dir, cfg_dict, fingerprint)):
            yield message
            # After 64 samples: shards committed or mid-commit on the writer's background thread.
            if number == 2 and input_path.endswith("big.tar") and not os.path.exists(marker):
                open(marker, "w").close()
                os._exit(1)

    monkeypatch.setattr(ray_tasks, "_task", task_whose_worker_dies_once)
    log = tmp_path / "events.jsonl"
    result = run_cli(pattern, "--output", out, "--log-format", "json", "--log-file", str(log), extra=extra)
    assert result.exit_code == 0, result.output
    assert os.path.exists(marker), "the worker never died: the test did not test anything"
    events = [json.loads(line) for line in log.read_text().splitlines()]
    assert any(e["event"] == "input_retried" and e["input"].endswith("big.tar") for e in events), events
    assert_same_dataset(out, reference)
    assert_clean(out)
    assert_indices(out, list(range(105)))


def _enospc(path: str = "") -> OSError:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), *([path] if path else []))


def test_disk_full_in_a_worker_stops_the_run_and_keeps_the_previous_dataset(ray_cluster, tars, tmp_path, monkeypatch):
    tars.make("a.tar", range(0, 10))
    out = str(tmp_path / "out")
    assert run_cli(tars.made[0], "--output", out).exit_code == 0
    manifest_before = open(os.path.join(out, "manifest.json"), "rb").read()
    tars.make("b.tar", range(10, 30))

    real_task = ray_tasks._task

    def task_on_a_full_disk(input_path, output_dir, cfg_dict, fingerprint):
        # Only modules and closure cells in here: a module-level helper of this test file would be pickled
        # by reference, and the workers cannot import it.
        from shardio.write import shard_writer as writer

        def full_disk(self, data):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        real_write = writer._OpenFile.write
        writer._OpenFile.write = full_disk
        try:
            yield from real_task(input_path, output_dir, cfg_dict, fingerprint)
        finally:
            writer._OpenFile.write = real_write

    monkeypatch.setattr(ray_tasks, "_task", task_on_a_full_disk)
    result = runner.invoke(app, ["run", f"{tars.directory}/*.tar", "--output", out, *FLAGS, "-q"])
    message = " ".join(result.output.split())
    assert result.exit_code == 1, (result.output, result.exception)
    assert "output disk full" in message and "No space left on device" in message and "b.tar" in message
    assert "published nothing partial" in message and "10 samples" in message
    assert open(os.path.join(out, "manifest.json"), "rb").read() == manifest_before
    assert_clean(out, run_stopped_early=True)  # its cancelled tasks: the next run looks at every file again
    assert_indices(out, list(range(10)))

    monkeypatch.setattr(ray_tasks, "_task", real_task)  # space freed: the rerun completes
    assert run_cli(f"{tars.directory}/*.tar", "--output", out).exit_code == 0
    assert_indices(out, list(range(30)))


def test_disk_full_writing_the_manifest_publishes_nothing(ray_cluster, tars, tmp_path, monkeypatch):
    tars.make("a.tar", range(0, 10))
    out = str(tmp_path / "out")
    assert run_cli(tars.made[0], "--output", out).exit_code == 0
    manifest_before = open(os.path.join(out, "manifest.json"), "rb").read()
    tars.make("b.tar", range(10, 30))

    real_writer = atomic_writer

    def write_half_then_fill_the_disk(self, path: str, data: bytes, if_version: str | None = None) -> str:
        with real_writer(path) as f:
            f.write(data[: len(data) // 2])
            raise _enospc(path)

    monkeypatch.setattr(LocalStorage, "publish", write_half_then_fill_the_disk)
    result = runner.invoke(app, ["run", f"{tars.directory}/*.tar", "--output", out, *FLAGS, "-q"])
    message = " ".join(result.output.split())
    assert result.exit_code == 1, (result.output, result.exception)
    assert "output disk full (writing the manifest" in message and "No space left on device" in message
    assert open(os.path.join(out, "manifest.json"), "rb").read() == manifest_before
    assert_clean(out)  # b.tar's finished shards were removed with the temp manifest: nothing unlisted
    assert_indices(out, list(range(10)))


# --- mode: bucket --------------------------------------------------------------------------------------------------

def _start_bucket_run(pattern: str, out: str, address: str, log: str, encoding: str) -> subprocess.Popen:
    with open(log, "ab") as stderr:
        return subprocess.Popen([sys.executable, "-m", "preprocess.cli", "run", pattern, "--output", out, *BUCKET_FLAGS,
                                 "--encoding", encoding, "-q", "--ray-address", address],
                                stdout=subprocess.DEVNULL, stderr=stderr)


@pytest.mark.slow
@pytest.mark.parametrize("encoding", ["raw", "jpeg"])
def test_kill_9_then_rerun_gives_the_uninterrupted_dataset(ray_cluster, tars, tmp_path, encoding) -> None:
    pattern, samples = make_bucket_tars(tars, [40, 25, 33, 9])
    log, reference = str(tmp_path / "runs.log"), str(tmp_path / "reference")
    run = _start_bucket_run(pattern, reference, ray_cluster, log, encoding)
    startup_s, whole_s = watch(run, reference)
    assert run.returncode == 0, open(log).read()
    check_buckets(reference, samples)
    outs = kill_while_writing_then_rerun(
        lambda out: _start_bucket_run(pattern, out, ray_cluster, log, encoding),
        lambda out: runner.invoke(app, ["run", pattern, "--output", out, *BUCKET_FLAGS, "--encoding", encoding, "-q"],
                                  catch_exceptions=False),
        reference, tmp_path, seed=32, write_s=whole_s - startup_s)
    for out in outs:
        assert list(shardio.open_dataset(out).shard_buckets) == list(shardio.open_dataset(reference).shard_buckets)
