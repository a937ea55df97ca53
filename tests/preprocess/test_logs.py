"""The job's structured log (``--log-format``, ``--log-file``) and the library version drift check."""

from __future__ import annotations

import gzip
import io
import json
import os

import pytest
from typer.testing import CliRunner

from preprocess.cli import app
from preprocess.config import JobConfig
from preprocess.job import RunReport
from preprocess.logging_events import EventLogger
from preprocess.cluster.ray_tasks import AttemptTracker, Progress, TaskEvent
from preprocess.inputs.resolve import resolve_inputs
from preprocess.image.versions import library_versions
from preprocess.worker import PROGRESS_EVERY, InputResult, iter_process_input
from shardio.store.backends import for_path
from shardio.format import InputEntry, Manifest
from shardio.write.shard_writer import write_manifest
from tests.folder_factory import flat_folder
from tests.parquet_factory import hf_table, write_parquet

runner = CliRunner()


def records(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def test_retries_show_as_a_new_worker_for_the_same_input():
    tracker = AttemptTracker()
    started = tracker.see(Progress("a.tar", 0, 0, "host/n1", "w1"))
    assert started == TaskEvent("started", "a.tar", "host/n1", "w1")
    assert tracker.see(Progress("a.tar", 32, 0, "host/n1", "w1")) is None
    assert tracker.see(Progress("b.tar", 0, 0, "host/n2", "w2")).kind == "started"
    retried = tracker.see(Progress("a.tar", 64, 1, "host/n2", "w3"))  # w1 died; Ray re-ran a.tar on w3
    assert retried == TaskEvent("retried", "a.tar", "host/n2", "w3", attempt=2, previous_worker="w1")
    assert tracker.see(Progress("a.tar", 96, 1, "host/n2", "w3")) is None


def test_one_json_record_per_event_with_counts_node_and_duration():
    out = io.StringIO()
    log = EventLogger(out, "json")
    log("plan", {"todo": 2, "skipped": 1, "cluster": {"nodes": 2, "cpus": 4}})
    log("started", TaskEvent("started", "a.tar", "host/n1", "w1"))
    log("progress", Progress("a.tar", 32, 0, "host/n1", "w1"))  # not logged
    log("retried", TaskEvent("retried", "a.tar", "host/n2", "w2", 2, "w1"))
    log("input", InputResult("a.tar", 1, 1, samples=40, shards=[{}, {}], failures=[{"key": "k"}],
                             elapsed_s=1.25, node="host/n2"))
    log("input", InputResult("b.tar", 1, 1, error="not a readable tar", elapsed_s=0.5, node="host/n1"))
    lines = records(out.getvalue())
    assert [r["event"] for r in lines] == ["run_planned", "input_started", "input_retried", "input_finished",
                                           "input_failed"]
    assert lines[0]["inputs_todo"] == 2 and lines[0]["nodes"] == 2
    assert lines[2]["attempt"] == 2 and lines[2]["previous_worker"] == "w1"
    finished = lines[3]
    assert finished["input"] == "a.tar" and finished["node"] == "host/n2" and finished["duration_s"] == 1.25
    assert (finished["samples"], finished["failed"], finished["shards"]) == (40, 1, 2)
    assert (finished["inputs_done"], finished["inputs_todo"], finished["samples_total"]) == (1, 2, 40)
    assert lines[4]["reason"] == "not a readable tar" and lines[4]["inputs_done"] == 2
    assert all(r["time"].endswith("Z") for r in lines)


def test_human_lines_name_the_event_input_duration_and_counts():
    out = io.StringIO()
    log = EventLogger(out, "human")
    log("plan", {"todo": 1, "skipped": 0})
    log("input", InputResult("/data/a.tar", 1, 1, samples=7, elapsed_s=2.5, node="host/n1"))
    line = out.getvalue().splitlines()[1]
    assert "input_finished" in line and "/data/a.tar" in line and "2.50 s" in line and "[1/1]" in line
    assert "samples=7" in line and "node=host/n1" in line
    with pytest.raises(ValueError):
        EventLogger(out, "xml")


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_progress_inside_inputs_is_logged_at_most_once_per_interval():
    """A big Parquet file or folder is not silent between input_started and input_finished: a progress
    record says the run's and each running input's samples, share and ETA, once per interval."""
    out, clock = io.StringIO(), FakeClock()
    log = EventLogger(out, "json", progress_interval_s=30.0, clock=clock)
    log("plan", {"todo": 2, "skipped": 0, "todo_bytes": 4000})
    reports = [(10, Progress("big.parquet", 0, 0, "h/n1", "w1", None, None, 3000)),
               (20, Progress("big.parquet", 32, 0, "h/n1", "w1", 0.32, 100, 3000)),
               (29, Progress("small.tar", 0, 0, "h/n2", "w2", None, None, 1000)),
               (31, Progress("big.parquet", 64, 1, "h/n1", "w1", 0.65, 100, 3000)),
               (45, Progress("small.tar", 32, 0, "h/n2", "w2", 0.5, None, 1000)),
               (62, Progress("big.parquet", 96, 1, "h/n1", "w1", 0.97, 100, 3000))]
    for at, progress in reports:
        clock.now = 1000.0 + at
        log("progress", progress)
    said = [r for r in records(out.getvalue()) if r["event"] == "progress"]
    assert len(said) == 2, "one record per 30 s, whatever the number of worker reports"
    first = said[0]
    assert (first["inputs_done"], first["inputs_todo"], first["inputs_running"]) == (0, 2, 2)
    assert first["samples_total"] == 64 and first["images_per_s"] == round(64 / 31, 1)
    assert first["fraction"] == round(0.65 * 3000 / 4000, 3)
    big, small = first["running"]
    assert big == {"input": "big.parquet", "samples": 64, "expected": 100, "fraction": 0.65,
                   "eta_s": round(21 * 0.35 / 0.65, 1)}  # started at +10 s, 65% read at +31 s
    assert small == {"input": "small.tar", "samples": 0}  # no share read yet: no ETA
    assert said[1]["running"][1]["fraction"] == 0.5 and said[1]["eta_s"] > 0
    log("input", InputResult("big.parquet", 3000, 1, samples=99, elapsed_s=50.0))
    clock.now += 30
    log("progress", Progress("small.tar", 40, 0, "h/n2", "w2", 0.9, None, 1000))
    last = records(out.getvalue())[-1]
    assert last["event"] == "progress" and last["inputs_done"] == 1 and last["samples_total"] == 139
    assert [r["input"] for r in last["running"]] == ["small.tar"]


def test_a_zero_interval_logs_every_report_and_human_lines_name_the_running_inputs():
    out, clock = io.StringIO(), FakeClock()
    log = EventLogger(out, "human", progress_interval_s=0.0, clock=clock)
    log("plan", {"todo": 1, "skipped": 0, "todo_bytes": 100})
    for done in (0, 32, 64):
        clock.now += 10
        log("progress", Progress("/data/big.parquet", done, 0, "h/n1", "w1", done / 128, 128, 100))
    lines = [line for line in out.getvalue().splitlines() if " progress " in line]
    assert len(lines) == 3
    assert "[0/1]" in lines[-1] and "samples_total=64" in lines[-1]
    assert "running: /data/big.parquet 64/128 samples (50.0%, ETA 20 s)" in lines[-1]


def test_off_a_terminal_the_display_prints_progress_lines_and_the_bar_counts_inputs(monkeypatch):
    from rich.console import Console
    from rich.progress import TextColumn

    from preprocess import run_display

    stream, clock = io.StringIO(), FakeClock()
    monkeypatch.setattr(run_display, "console", Console(file=stream, width=80))  # a pipe: plain lines
    display = run_display.RunDisplay(False, progress_interval_s=30.0, clock=clock)
    display("plan", {"todo": 2, "skipped": 0, "todo_bytes": 200})
    for at, done in ((10, 0), (20, 32), (35, 64)):
        clock.now = 1000.0 + at
        display("progress", Progress("/data/photos/", done, 0, "h/n1", "w1", done / 128, 128, 100))
    display("input", InputResult("/data/photos/", 100, 1, samples=128, elapsed_s=30.0))
    lines = stream.getvalue().splitlines()
    said = [line for line in lines if line.startswith("progress: ")]
    assert said == ["progress: 0/2 inputs, 64 samples, 2 images/s, 25.0%, ETA 1 min 45 s; "
                    "running: /data/photos/ 64/128 samples (50.0%, ETA 25 s)"]
    assert lines[-1] == "/data/photos/: 128 samples (30.0 s)"

    monkeypatch.setattr(run_display, "console", Console(file=io.StringIO(), force_terminal=True))
    live = run_display.RunDisplay(False)
    live("plan", {"todo": 2, "skipped": 0})
    words = [column.text_format for column in live.progress.columns if isinstance(column, TextColumn)]
    live.close()
    assert "inputs" in words and "tars" not in words


@pytest.mark.parametrize("kind", ["tar", "tar.gz", "parquet", "folder"])
def test_every_input_kind_reports_how_far_it_is(kind, tars, tmp_path):
    """The worker's reports within one input carry the share read (and the count where the reader knows
    it first), whatever the kind: rows of a Parquet file, images of a folder, bytes of a tar."""
    samples = 2 * PROGRESS_EVERY + 6
    if kind == "parquet":
        path = write_parquet(str(tmp_path / "big.parquet"), hf_table(range(samples)), row_group_size=16)
    elif kind == "folder":
        path = flat_folder(tmp_path / "photos", range(samples))
    else:
        path = tars.make("big.tar", range(samples))
        if kind == "tar.gz":
            path = tars.derive("big.tar.gz", path, gzip.compress)
    cfg = JobConfig(height=16, width=16, samples_per_shard=16)
    resolved = resolve_inputs([path], cfg.image_extensions)
    path = resolved.paths[0]
    steps = iter_process_input(path, str(tmp_path / "out"), cfg, resolved.listed[path])
    reports = []
    while True:
        try:
            reports.append(next(steps))
        except StopIteration as stop:
            assert stop.value.error is None and stop.value.samples == samples
            break
    assert [r.done for r in reports] == [PROGRESS_EVERY, 2 * PROGRESS_EVERY]
    fractions = [r.fraction for r in reports]
    if kind in ("parquet", "folder"):
        assert [r.expected for r in reports] == [samples, samples]
        assert fractions == [PROGRESS_EVERY / samples, 2 * PROGRESS_EVERY / samples]
    elif kind == "tar":  # by the bytes of the members read
        assert all(r.expected is None for r in reports)
        assert 0 < fractions[0] < fractions[1] < 1
    else:  # by the compressed bytes consumed, read ahead in chunks (this small file: in one)
        assert all(r.expected is None for r in reports)
        assert 0 < fractions[0] <= fractions[1] <= 1


@pytest.mark.ray
def test_run_writes_json_lines_for_each_input(ray_cluster, tars, tmp_path):
    tars.make("a.tar", range(5))
    tars.make("b.tar", range(5, 9))
    junk = tars.path("c.tar")
    open(junk, "wb").write(b"\x00junk" * 50)
    log_file, out = tmp_path / "run.log", str(tmp_path / "out")
    result = runner.invoke(app, ["run", f"{tars.directory}/*.tar", str(tmp_path / "missing.tar"),
                                 "--output", out, "--size", "16", "-q", "--log-format", "json",
                                 "--log-file", str(log_file)])
    assert result.exit_code == 1, result.output
    lines = records(log_file.read_text())
    events = [r["event"] for r in lines]
    assert events[0] == "run_planned" and events[-1] == "run_finished"
    started = {os.path.basename(r["input"]) for r in lines if r["event"] == "input_started"}
    assert started == {"a.tar", "b.tar", "c.tar"} and all(r["node"] for r in lines if "worker" in r)
    finished = {os.path.basename(r["input"]): r for r in lines if r["event"] == "input_finished"}
    assert finished["a.tar"]["samples"] == 5 and finished["b.tar"]["samples"] == 4
    assert all(r["duration_s"] > 0 and "/" in r["node"] for r in finished.values())
    failed = {os.path.basename(r["input"]): r["reason"] for r in lines if r["event"] == "input_failed"}
    assert set(failed) == {"c.tar", "missing.tar"} and "no such file" in failed["missing.tar"]
    assert lines[-1]["samples_written"] == 9 and lines[-1]["exit_code"] == 1


@pytest.mark.ray
def test_a_run_logs_progress_inside_a_folder_and_a_parquet_file(ray_cluster, tmp_path):
    """Off a terminal (a log file here) a folder and a Parquet file each say how far they are while they
    run: with an interval of 0, one progress record per worker report (every PROGRESS_EVERY samples)."""
    samples = 2 * PROGRESS_EVERY + 6
    folder = flat_folder(tmp_path / "photos", range(samples))
    parquet = write_parquet(str(tmp_path / "rows.parquet"), hf_table(range(samples, 2 * samples)),
                            row_group_size=16)
    log_file, out = tmp_path / "run.log", str(tmp_path / "out")
    result = runner.invoke(app, ["run", folder, parquet, "--output", out, "--size", "16", "--log-format",
                                 "json", "--log-file", str(log_file), "--progress-interval", "0"])
    assert result.exit_code == 0, result.output
    said = [r for r in records(log_file.read_text()) if r["event"] == "progress"]
    for name in (folder, parquet):
        seen = {entry["samples"]: entry for r in said for entry in r["running"]
                if entry["input"].rstrip("/") == name}
        assert seen[PROGRESS_EVERY]["expected"] == samples, said
        assert seen[PROGRESS_EVERY]["fraction"] == round(PROGRESS_EVERY / samples, 3)
        assert seen[2 * PROGRESS_EVERY]["fraction"] == round(2 * PROGRESS_EVERY / samples, 3)
    assert said[-1]["samples_total"] >= samples and said[-1]["inputs_todo"] == 2
    # stderr is no terminal here either: the display says progress as plain lines, and never wraps them
    assert any(line.startswith("progress: ") and "inputs," in line for line in result.output.splitlines())


def _dataset_written_with(directory: str, committed_tar: str, versions: dict) -> None:
    """A dataset whose manifest lists ``committed_tar`` as done, so a rerun skips it and needs no Ray."""
    cfg = JobConfig(height=16, width=16)
    size, mtime_ns = for_path(committed_tar).stat_fingerprint(committed_tar)
    manifest = Manifest(shape=(16, 16, 3), config=cfg.output_dict(), versions=versions,
                        inputs={committed_tar: InputEntry(size=size, mtime_ns=mtime_ns, samples=0, failed=0)})
    os.makedirs(directory, exist_ok=True)
    write_manifest(directory, manifest)


def test_appending_with_another_libjpeg_turbo_warns_and_strict_versions_refuses(tars, tmp_path):
    tar = tars.make("a.tar", range(3))
    out = str(tmp_path / "out")
    _dataset_written_with(out, tar, {**library_versions(), "libjpeg_turbo": "1.5.3"})
    log_file = tmp_path / "run.jsonl"
    result = runner.invoke(app, ["run", tar, "--output", out, "--size", "16", "--log-format", "json",
                                 "--log-file", str(log_file)])
    assert result.exit_code == 0, result.output
    flat = result.output.replace("\n", " ")
    assert "warning:" in flat and "libjpeg_turbo 1.5.3" in flat and "may differ in pixels" in flat
    warning = [r for r in records(log_file.read_text()) if r["event"] == "warning"]
    assert len(warning) == 1 and "libjpeg_turbo" in warning[0]["message"]
    report_name = sorted(os.listdir(os.path.join(out, "reports")))[-1]
    report = json.load(open(os.path.join(out, "reports", report_name)))
    assert len(report["warnings"]) == 1

    _dataset_written_with(out, tar, {**library_versions(), "pillow": "9.0.0"})
    result = runner.invoke(app, ["run", tar, "--output", out, "--size", "16", "--strict-versions"])
    assert result.exit_code == 2
    assert "pillow 9.0.0" in result.output.replace("\n", " ")


def test_same_versions_or_no_recorded_versions_do_not_warn(tars, tmp_path):
    tar = tars.make("a.tar", range(3))
    for versions in (library_versions(), {}):
        out = str(tmp_path / f"out{len(versions)}")
        _dataset_written_with(out, tar, versions)
        result = runner.invoke(app, ["run", tar, "--output", out, "--size", "16", "--strict-versions"])
        assert result.exit_code == 0 and "warning" not in result.output, result.output


def test_bad_log_format_is_a_usage_error(tars, tmp_path):
    result = runner.invoke(app, ["run", tars.make("a.tar", range(1)), "--output", str(tmp_path / "o"),
                                 "--log-format", "xml"])
    assert result.exit_code == 2 and "--log-format" in result.output


def test_ray_output_and_an_interrupted_run_are_json_records():
    stream = io.StringIO()
    log = EventLogger(stream, "json")
    log("ray", "2026-01-01 00:00:00,000\tWARNING authentication_token_setup.py:85 -- Token authentication ...")
    report = RunReport(run_id="r", output="o", started="s", config={}, interrupted="SIGTERM",
                       inputs_unfinished=["b.tar"])
    log.finish(report)
    ray_line, finished = records(stream.getvalue())
    assert ray_line["event"] == "ray" and "Token authentication" in ray_line["line"]
    assert finished["event"] == "run_finished" and finished["interrupted"] == "SIGTERM"
    assert finished["exit_code"] == 143


def test_a_refused_run_in_json_mode_prints_only_json(ray_cluster, tars, tmp_path):
    tar = tars.make("a.tar", range(2))
    out = str(tmp_path / "out")
    assert runner.invoke(app, ["run", tar, "--output", out, "--size", "16", "-q"]).exit_code == 0
    result = runner.invoke(app, ["run", tar, "--output", out, "--size", "24", "--log-format", "json"])
    assert result.exit_code == 2
    (error,) = records(result.output)  # every line is JSON: no human "error:" line beside the record
    assert error["event"] == "error" and "different config" in error["message"]
