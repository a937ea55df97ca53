"""An input whose bytes are broken (a truncated ``.tar.gz``) is read once: the run that finds it records its
fingerprint in the report, and a rerun with nothing new reports it failed again without reading it or
starting Ray (it took 7.3 s instead of 1.07 s, every night, to fail the same way). A changed file, or
``--retry-failed``, reads it again. The samples decoded before the break are counted as not kept."""

from __future__ import annotations

import gzip
import json
import os

import pytest
from typer.testing import CliRunner

from preprocess import job
from preprocess.cli import app
from preprocess.remembered_failures import remembered_failures
from shardio.format.run_report import latest_report

pytestmark = pytest.mark.ray
runner = CliRunner()
FLAGS = ["--size", "16", "--samples-per-shard", "8", "-q"]


class RayStarted(Exception):
    pass


def no_ray(*args, **kwargs):
    raise RayStarted("the run started Ray")


@pytest.fixture
def broken(tars) -> tuple[str, str]:
    """A good tar and a gzipped one cut in half (its first samples decode, then the stream breaks)."""
    good = tars.make("a.tar", range(5))
    whole = tars.derive("whole.tar.gz", tars.make("b.tar", range(40)), gzip.compress)
    cut = tars.derive("cut.tar.gz", whole, lambda data: data[: len(data) // 2])
    os.remove(whole)
    return good, cut


def test_a_broken_input_is_read_once_and_remembered_until_it_changes(ray_cluster, broken, tmp_path, monkeypatch):
    good, cut = broken
    out = str(tmp_path / "out")
    first = runner.invoke(app, ["run", good, cut, "--output", out, *FLAGS])
    assert first.exit_code == 1, first.output
    found = latest_report(out)
    (failed,) = found["inputs_failed"]
    size, mtime_ns = os.stat(cut).st_size, os.stat(cut).st_mtime_ns
    assert failed["input"] == cut and failed["failed_in"] == found["run_id"]
    assert failed["fingerprint"] == {"size": size, "mtime_ns": mtime_ns, "etag": ""}
    assert failed["samples_lost"] > 0 and f"the {failed['samples_lost']} sample(s) decoded before it were not " \
        "kept: an input is committed whole or not at all" in failed["reason"]

    # Nothing new: answered from the report, without Ray; still exit 1, the input still failed.
    monkeypatch.setattr(job, "ray_session", no_ray)
    again = runner.invoke(app, ["run", good, cut, "--output", out, *FLAGS])
    assert again.exit_code == 1, again.output
    said = " ".join(again.output.split())
    assert f"error: input failed: {cut}: {failed['reason']} (found by run {found['run_id']}; unchanged since, so " \
           "not read again: --retry-failed reads it)" in said, said
    remembered = latest_report(out)
    assert remembered["run_id"] != found["run_id"] and remembered["inputs_failed"] == [failed]
    assert remembered["samples_written"] == 0 and remembered["inputs_skipped_count"] == 1
    # ... and the next rerun remembers it from that report in turn.
    assert runner.invoke(app, ["run", good, cut, "--output", out, *FLAGS]).exit_code == 1

    # --retry-failed reads it again (here: Ray would start).
    with pytest.raises(RayStarted):
        runner.invoke(app, ["run", good, cut, "--output", out, "--retry-failed", *FLAGS], catch_exceptions=False)
    # So does a changed file: the fingerprint differs.
    os.utime(cut, ns=(mtime_ns + 10**9, mtime_ns + 10**9))
    with pytest.raises(RayStarted):
        runner.invoke(app, ["run", good, cut, "--output", out, *FLAGS], catch_exceptions=False)


def test_only_a_failure_of_the_bytes_is_remembered(broken, tars, tmp_path):
    """A broken tar fails the same way every time; a read error (here a folder named like a tar: open
    fails) is the disk's or the permissions', which a retry may cure: the next run reads it again."""
    from preprocess.config import JobConfig
    from preprocess.worker import process_input
    from shardio.format.run_report import RunReport

    _, cut = broken
    folder = tars.path("folder.tar")
    os.makedirs(folder)
    report = RunReport(run_id="r1", output="o", started="", config={})
    for path in (cut, folder):
        result = process_input(path, str(tmp_path / "out"), JobConfig(height=16, width=16), (100, 1))
        assert result.error
        job._record(report, result)
    broken_entry, folder_entry = report.inputs_failed
    assert broken_entry["fingerprint"] == {"size": 100, "mtime_ns": 1, "etag": ""} and broken_entry["failed_in"] == "r1"
    assert "fingerprint" not in folder_entry and "failed_in" not in folder_entry


def test_the_report_of_a_remembered_failure_is_plain_json(broken, tmp_path, monkeypatch):
    """What the next run reads is the report's own format: the entry as written (no objects)."""
    good, cut = broken
    out = tmp_path / "out"
    (out / "reports").mkdir(parents=True)
    entry = {"input": cut, "reason": "truncated", "failed_in": "20260101T000000Z-abcdef",
             "fingerprint": {"size": os.stat(cut).st_size, "mtime_ns": os.stat(cut).st_mtime_ns, "etag": ""}}
    (out / "reports" / "20260101T000000Z-abcdef.json").write_text(json.dumps({"inputs_failed": [entry]}))
    assert remembered_failures(str(out)) == {cut: entry}
