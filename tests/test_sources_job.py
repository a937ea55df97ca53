"""The job over sources other than tars: the same commit, incremental reruns and kill -9 safety as tars.

A Parquet file is an input as a tar is: a rerun processes only a new file, a changed one is replaced, and
a run killed at any moment then rerun gives the uninterrupted run's dataset byte for byte.
"""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from preprocess.cli import app
from tests.dataset_compare import assert_clean, assert_indices, assert_same_dataset
from tests.folder_factory import flat_folder
from tests.parquet_factory import hf_table, img2dataset_table, write_parquet
from tests.test_crash_safety import start_run, wait_for_dead_runs_tasks, watch

pytestmark = pytest.mark.ray
runner = CliRunner()
FLAGS = ["--size", "32", "--samples-per-shard", "8"]


def run_cli(*args: str):
    return runner.invoke(app, ["run", *args, *FLAGS, "-q"], catch_exceptions=False)


def test_tars_and_parquet_in_one_dataset_and_a_new_parquet_file_is_the_only_input_a_rerun_processes(
        ray_cluster, tars, tmp_path):
    tars.make("a.tar", range(0, 9))
    write_parquet(tars.path("b.parquet"), hf_table(range(9, 20)))
    patterns = [f"{tars.directory}/*.tar", f"{tars.directory}/*.parquet"]
    out, report = str(tmp_path / "out"), str(tmp_path / "r.json")
    assert run_cli(*patterns, "--output", out, "--report", report).exit_code == 0
    assert len(json.load(open(report))["inputs_processed"]) == 2
    new = write_parquet(tars.path("c.parquet"), img2dataset_table(range(20, 26), failed={23}))
    result = run_cli(*patterns, "--output", out, "--report", report)
    assert result.exit_code == 0, result.output
    doc = json.load(open(report))
    assert doc["inputs_processed"] == [new] and doc["inputs_skipped_count"] == 2
    assert [(f["key"], f["code"]) for f in doc["failures"]] == [("000023", "missing_image")]
    assert "row 3: no image bytes" in doc["failures"][0]["reason"]
    expected = [i for i in range(26) if i != 23]
    assert_indices(out, expected)
    # The same as one run over everything, byte for byte.
    single = str(tmp_path / "single")
    assert run_cli(*patterns, "--output", single).exit_code == 0
    assert_same_dataset(out, single)
    assert_clean(out)
    # A changed file (rewritten: size and mtime differ) is replaced, as a changed tar is.
    write_parquet(tars.path("b.parquet"), hf_table(range(9, 14)))
    assert run_cli(*patterns, "--output", out, "--report", report).exit_code == 0
    assert json.load(open(report))["inputs_processed"] == [tars.path("b.parquet")]
    assert_indices(out, [i for i in expected if not 14 <= i < 20])  # its old shards: retired, kept 24 h


def test_a_run_over_parquet_killed_while_writing_then_rerun_gives_the_uninterrupted_dataset(
        ray_cluster, tars, tmp_path):
    start = 0
    for number, size in enumerate([70, 45, 23]):
        write_parquet(tars.path(f"{number:02d}.parquet"), hf_table(range(start, start + size)), row_group_size=16)
        start += size
    pattern, log = f"{tars.directory}/*.parquet", str(tmp_path / "runs.log")
    reference = str(tmp_path / "reference")
    assert run_cli(pattern, "--output", reference).exit_code == 0
    out = str(tmp_path / "killed")
    run = start_run(pattern, out, ray_cluster, log)
    watch(run, out, ("write", 0.05))  # SIGKILL once its first shard file is there: mid-processing
    wait_for_dead_runs_tasks()
    assert run_cli(pattern, "--output", out).exit_code == 0
    assert_same_dataset(out, reference)
    assert_clean(out)
    assert_indices(out, list(range(start)))


def test_a_folder_is_one_input_skipped_unchanged_and_processed_again_when_a_file_lands(ray_cluster, tmp_path):
    folder = flat_folder(tmp_path / "photos", range(5))
    out, report = str(tmp_path / "out"), str(tmp_path / "r.json")
    assert run_cli(folder, "--output", out, "--report", report).exit_code == 0
    assert json.load(open(report))["inputs_processed"] == [folder]
    assert run_cli(folder, "--output", out, "--report", report).exit_code == 0
    assert json.load(open(report))["inputs_skipped_count"] == 1
    flat_folder(folder, range(5, 7))
    assert run_cli(folder, "--output", out, "--report", report).exit_code == 0
    assert json.load(open(report))["inputs_processed"] == [folder]
    assert_indices(out, list(range(7)))
