"""The job over sources other than tars: the same commit, incremental reruns and kill -9 safety as tars.

A Parquet file is an input as a tar is: a rerun processes only a new file, a changed one is replaced, and
a run killed at any moment then rerun gives the uninterrupted run's dataset byte for byte.
"""

from __future__ import annotations

import json
import os

import pytest
from typer.testing import CliRunner

from preprocess.cli import app
from tests.dataset_compare import assert_clean, assert_indices, assert_same_dataset
from tests.folder_factory import flat_folder
from tests.parquet_factory import hf_table, img2dataset_table, write_parquet
from tests.preprocess.test_crash_safety import start_run, wait_for_dead_runs_tasks, watch

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


def _source(parts: dict[str, tuple[range, str]], as_arrays: bool = False):
    """A source of ``parts`` (input name -> (sample indices, version)) giving the samples
    ``TarFactory.samples`` puts in a tar: the same keys, pixels and metadata. The function is a closure over
    plain data: Ray ships it by value."""
    import numpy as np

    from preprocess.inputs.sources import Sample, Source, SourceInput
    from tests.tar_factory import index_image, jpeg_bytes

    indices = {name: list(r) for name, (r, _) in parts.items()}

    def samples(item: SourceInput):
        for i in indices[item.name]:
            image = jpeg_bytes(index_image(i))
            if as_arrays:  # the decoded JPEG: the same pixels the tar's bytes decode to
                from PIL import Image
                import io

                image = np.asarray(Image.open(io.BytesIO(image)).convert("RGB"))
            yield Sample(f"{i:06d}", image, txt=f"caption {i}", json={"index": i}, cls=i)

    return Source("db", [SourceInput(name, version) for name, (_, version) in parts.items()], samples)


def _run_source(source, out: str):
    from preprocess.config import JobConfig
    from preprocess.job import RunOptions, run_job

    return run_job(RunOptions(inputs=[], output=out, config=JobConfig(height=32, width=32, samples_per_shard=8),
                              source=source))


@pytest.mark.parametrize("as_arrays", [False, True], ids=["bytes", "arrays"])
def test_a_python_source_gives_the_tar_datasets_samples_and_reruns_only_new_or_changed_inputs(
        ray_cluster, tars, tmp_path, as_arrays):
    import shardio

    tars.make("a.tar", range(0, 9))
    tars.make("b.tar", range(9, 14))
    from_tars = str(tmp_path / "from-tars")
    assert run_cli(f"{tars.directory}/*.tar", "--output", from_tars).exit_code == 0
    out = str(tmp_path / "source")
    report = _run_source(_source({"a": (range(0, 9), "v1"), "b": (range(9, 14), "v1")}, as_arrays), out)
    assert report.exit_code == 0 and sorted(report.inputs_processed) == ["db/a", "db/b"]
    mine, theirs = shardio.open_dataset(out), shardio.open_dataset(from_tars)
    for shard in range(len(theirs.shards)):
        assert (mine.pixels(shard) == theirs.pixels(shard)).all()
    assert_indices(out, list(range(14)))
    # A new input and a changed version: only those two are processed.
    report = _run_source(_source({"a": (range(0, 9), "v1"), "b": (range(9, 12), "v2"), "c": (range(20, 23), "v1")},
                                 as_arrays), out)
    assert sorted(report.inputs_processed) == ["db/b", "db/c"] and report.inputs_skipped_count == 1
    assert_indices(out, [*range(0, 12), *range(20, 23)])


def test_a_python_source_whose_function_fails_fails_that_input_only(ray_cluster, tmp_path):
    from preprocess.inputs.sources import Sample, Source, SourceInput
    from tests.tar_factory import index_image, jpeg_bytes

    def samples(item: SourceInput):
        yield Sample("k0", jpeg_bytes(index_image(0)))
        yield Sample("k1", None)
        if item.name == "bad":
            raise KeyError("row 7 of the database")

    source = Source("db", [SourceInput("good", "1"), SourceInput("bad", "1")], samples)
    report = _run_source(source, str(tmp_path / "out"))
    assert report.inputs_processed == ["db/good"] and report.exit_code == 1
    [failed] = report.inputs_failed
    assert failed["input"] == "db/bad"
    assert "the source's samples() raised KeyError: 'row 7 of the database'" in failed["reason"]
    assert [(f["key"], f["code"]) for f in report.failures] == [("k1", "missing_image")]


def test_an_item_that_is_no_sample_is_a_counted_failure_naming_it_and_the_rest_is_kept(ray_cluster, tmp_path):
    """A dict or None among the samples: a failure of that item (its position, type and repr, what a sample
    must be), the input's other samples committed; a function returning no iterable fails its input."""
    from preprocess.inputs.sources import Sample, Source, SourceInput
    from tests.tar_factory import index_image, jpeg_bytes

    def samples(item: SourceInput):
        if item.name == "returns-none":
            return None
        return iter([Sample("000000", jpeg_bytes(index_image(0))), {"key": "k", "image": b"..."}, None,
                     Sample("000003", jpeg_bytes(index_image(3)))])

    source = Source("db", [SourceInput("mixed", "1"), SourceInput("returns-none", "1")], samples)
    out = str(tmp_path / "out")
    report = _run_source(source, out)
    assert report.inputs_processed == ["db/mixed"] and report.samples_written == 2
    assert_indices(out, [0, 3])
    assert [(f["input"], f["key"], f["code"]) for f in report.failures] == [
        ("db/mixed", "item 1", "not_a_sample"), ("db/mixed", "item 2", "not_a_sample")]
    dict_item, none_item = (f["reason"] for f in report.failures)
    assert dict_item.startswith("item 1 of the input is a dict ({'key': 'k', 'image': b'...'}), not a "
                                "Sample: samples() must yield preprocess.inputs.sources.Sample(key=..., image=")
    assert none_item.startswith("item 2 of the input is a NoneType (None), not a Sample")
    [failed] = report.inputs_failed
    assert failed["input"] == "db/returns-none" and failed["reason"].startswith(
        "the source's samples() returned a NoneType (None), not an iterable of Sample")
    assert "fingerprint" not in failed  # the function's fault: the next run tries it again


PYTHON_SOURCE_SCRIPT = '''
import io
import sys

from PIL import Image

from preprocess.config import JobConfig
from preprocess.job import RunOptions, run_job
from preprocess.inputs.sources import Sample, Source, SourceInput


def samples(item):
    start, count = map(int, item.name.split("-")[1:])
    for i in range(start, start + count):
        colour = tuple(((i >> shift) % 16) * 16 + 8 for shift in (0, 4, 8))  # tar_factory's index_image
        out = io.BytesIO()
        Image.new("RGB", (1200, 900), colour).save(out, "JPEG", quality=95, subsampling=0)
        yield Sample(f"{i:06d}", out.getvalue(), cls=i)


SOURCE = Source("db", [SourceInput(f"part-{s:03d}-{c}", "v1") for s, c in ((0, 70), (70, 45), (115, 23))], samples)
CONFIG = JobConfig(height=32, width=32, samples_per_shard=8)

if __name__ == "__main__":
    report = run_job(RunOptions(inputs=[], output=sys.argv[1], config=CONFIG, source=SOURCE, ray_address=sys.argv[2]))
    sys.exit(report.exit_code)
'''


def test_a_python_source_run_killed_while_writing_then_rerun_gives_the_uninterrupted_dataset(ray_cluster, tmp_path):
    import runpy
    import subprocess
    import sys

    from preprocess.job import RunOptions, run_job

    script = tmp_path / "my_source.py"
    script.write_text(PYTHON_SOURCE_SCRIPT)
    loaded = runpy.run_path(str(script))  # the same functions, by value (not importable by name)
    source, config = loaded["SOURCE"], loaded["CONFIG"]
    reference = str(tmp_path / "reference")
    assert run_job(RunOptions(inputs=[], output=reference, config=config, source=source)).exit_code == 0
    out = str(tmp_path / "killed")
    with open(tmp_path / "run.log", "ab") as log:
        run = subprocess.Popen([sys.executable, str(script), out, ray_cluster], stdout=subprocess.DEVNULL,
                               stderr=log, cwd=os.getcwd(), env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                   [os.getcwd(), os.environ.get("PYTHONPATH", "")])})
    watch(run, out, ("write", 0.05))  # SIGKILL once its first shard file is there (or it finished: the same)
    print("python source run exit:", run.returncode)
    wait_for_dead_runs_tasks()
    assert run_job(RunOptions(inputs=[], output=out, config=config, source=source)).exit_code == 0
    assert_same_dataset(out, reference)
    assert_clean(out)
    assert_indices(out, list(range(138)))
