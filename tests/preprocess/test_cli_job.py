"""The job end to end through the CLI (in-process, typer's CliRunner): exit codes, report, shards; ``mode: bucket``
puts every sample once in a shard of its bucket's shape (tests/bucket_jobs.py), raw and JPEG."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from typer.testing import CliRunner

import shardio
from preprocess.cluster import ray_tasks
from preprocess.cli import app
from preprocess.config import JobConfig
from preprocess.image.buckets import nearest_bucket
from preprocess.job import RunOptions, RunReport, report_json, run_job
from tests.ray_helpers import occupy_node_cpu
from tests.bucket_jobs import JOB_BUCKETS, SOURCE_SIZES, check_buckets, make_bucket_tars, run_bucket_job
from tests.dataset_compare import dataset_state
from tests.tar_factory import Member, decode_index
from tests.legacy_format import legacy_doc
from tests.object_stores import unusable_credentials

pytestmark = pytest.mark.ray
runner = CliRunner()


def run_cli(*args: str):
    return runner.invoke(app, ["run", *args, "-q"], catch_exceptions=False)


def read_all(directory: str) -> tuple[list[int], list[str]]:
    ds = shardio.open_dataset(directory, verify=True)
    indices, keys = [], []
    for i in range(len(ds.shards)):
        pixels, meta = ds.pixels(i), ds.meta(i)
        indices += [decode_index(p) for p in pixels]
        keys += meta.keys
    return indices, keys


def test_tars_to_shards_keeps_every_sample_once_in_order(ray_cluster, tars, tmp_path):
    tars.make("a.tar", range(0, 23))
    tars.make("b.tar", range(23, 40))
    out = str(tmp_path / "out")
    result = run_cli(f"{tars.directory}/*.tar", "--output", out, "--size", "32", "--samples-per-shard", "8")
    assert result.exit_code == 0, result.output
    indices, keys = read_all(out)
    assert sorted(indices) == list(range(40)), "a sample is missing or duplicated"
    assert indices == list(range(40)), "samples are out of tar order"
    assert keys == [f"{i:06d}" for i in range(40)]
    manifest = legacy_doc(out)
    assert [s["samples"] for s in manifest["shards"]] == [8, 8, 7, 8, 8, 1]
    assert manifest["shape"] == [32, 32, 3] and manifest["samples"] == 40
    ds = shardio.open_dataset(out)
    meta = ds.meta(0)
    assert meta.txt[:2] == ["caption 0", "caption 1"] and list(meta.cls[:3]) == [0, 1, 2]
    assert meta.json[1] == {"index": 1}
    # A stranger reads a shard with numpy alone.
    first = np.load(os.path.join(out, manifest["shards"][0]["path"]), mmap_mode="r")
    assert first.shape == (8, 32, 32, 3) and first.dtype == np.uint8


def test_report_names_bad_samples_and_bad_inputs(ray_cluster, tars, tmp_path):
    good = tars.make("good.tar", range(5))
    members = tars.samples(range(10, 13)) + [
        Member("000013.jpg", b""),  # zero bytes
        Member("000014.jpg", b"this is text, not a jpeg"),
        Member("000015.txt", b"metadata but no image"),
    ]
    mixed = tars.write("mixed.tar", members)
    not_tar = tars.path("not_a_tar.tar")
    open(not_tar, "wb").write(b"\x00garbage" * 100)
    out, report_path = str(tmp_path / "out"), str(tmp_path / "report.json")
    result = run_cli(good, mixed, not_tar, str(tmp_path / "missing.tar"), "--output", out, "--size", "16",
                     "--report", report_path)
    assert result.exit_code == 1, result.output
    report = json.load(open(report_path))
    assert report["samples_written"] == 8 and report["samples_failed"] == 3
    reasons = {f["key"]: f["reason"] for f in report["failures"]}
    assert "empty" in reasons["000013"] and "text" in reasons["000014"] and "no image" in reasons["000015"]
    codes = {f["key"]: f["code"] for f in report["failures"]}
    assert codes == {"000013": "empty_member", "000014": "not_an_image", "000015": "missing_image"}
    failed = {os.path.basename(f["input"]): f["reason"] for f in report["inputs_failed"]}
    assert set(failed) == {"not_a_tar.tar", "missing.tar"}
    assert "no such file" in failed["missing.tar"]
    # -q silences progress, never why the run failed.
    said = " ".join(result.output.split())
    assert f"input failed: {not_tar}:" in said and f"input failed: {tmp_path / 'missing.tar'}: no such file" in said
    assert sorted(report["inputs_processed"]) == sorted([good, mixed])
    for key in ("inputs_skipped", "elapsed_s", "images_per_s"):
        assert key in report
    # The report is also kept in the output (the run history) and the good inputs are committed.
    assert os.listdir(os.path.join(out, "reports"))
    assert len(shardio.open_dataset(out)) == 8


def test_rerun_skips_committed_inputs(ray_cluster, tars, tmp_path):
    tars.make("a.tar", range(4))
    out = str(tmp_path / "out")
    assert run_cli(f"{tars.directory}/*.tar", "--output", out, "--size", "16").exit_code == 0
    tars.make("b.tar", range(4, 6))
    report_path = str(tmp_path / "r.json")
    assert run_cli(f"{tars.directory}/*.tar", "--output", out, "--size", "16", "--report", report_path).exit_code == 0
    report = json.load(open(report_path))
    assert [os.path.basename(p) for p in report["inputs_skipped"]] == ["a.tar"]
    assert [os.path.basename(p) for p in report["inputs_processed"]] == ["b.tar"]
    assert read_all(out)[0] == list(range(6))


@pytest.mark.parametrize(
    "args, message",
    [
        (["--size", "16", "--height", "8"], "not both"),
        (["--mode", "zoom"], "mode must be one of"),
        (["--samples-per-shard", "0"], "samples_per_shard"),
    ],
)
def test_usage_errors_exit_2(tmp_path, args, message):
    result = runner.invoke(app, ["run", "x.tar", "--output", str(tmp_path / "o"), *args])
    assert result.exit_code == 2
    assert message in result.output


@pytest.mark.parametrize("flag, word", [("--quiet", "true"), ("-q", "False"), ("--prune", "yes")])
def test_a_value_after_a_flag_is_a_usage_error_that_writes_nothing(tars, tmp_path, flag, word):
    """``--quiet true``: a flag takes no value, so ``true`` would be an INPUT, missing, and the run a failed
    one in the dataset's history. A missing INPUT spelled as a flag's value is refused before anything."""
    good = tars.make("a.tar", range(2))
    out = tmp_path / "out"
    result = runner.invoke(app, ["run", good, flag, word, "--output", str(out), "--size", "16"])
    assert result.exit_code == 2, result.output
    said = " ".join(result.output.split())
    assert f"INPUT {word!r}" in said and "takes no value" in said and "nothing was read or written" in said
    assert not out.exists()


def test_a_missing_input_named_like_a_flag_value_is_taken_when_it_exists(tars, tmp_path, monkeypatch):
    """Only a missing path is refused: a file really named ``true`` is an input like any other."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "true").write_bytes(b"")
    result = runner.invoke(app, ["run", "true", "--output", str(tmp_path / "o"), "--mode", "zoom"])
    # Past the check: the config's own error.
    assert result.exit_code == 2 and "mode must be one of" in result.output


def test_unknown_config_key_exits_2(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("height: 64\nwidht: 64\n")
    result = runner.invoke(app, ["run", "x.tar", "--output", str(tmp_path / "o"), "--config", str(config)])
    assert result.exit_code == 2
    assert "unknown key(s) widht" in result.output


def test_unreachable_ray_address_fails_fast(tars, tmp_path):
    tars.make("a.tar", range(2))
    result = runner.invoke(app, ["run", tars.made[0], "--output", str(tmp_path / "o"),
                                 "--ray-address", "127.0.0.1:1"])
    assert result.exit_code == 2
    assert "unreachable" in result.output


@pytest.mark.parametrize("cloud", ["gcs", "azure", "s3"])
def test_unusable_credentials_for_the_output_exit_2_naming_them_before_any_work(tars, tmp_path, monkeypatch,
                                                                               cloud):
    tars.make("a.tar", range(2))
    url, says = unusable_credentials(cloud, tmp_path, monkeypatch)
    result = runner.invoke(app, ["run", tars.made[0], "--output", url, "-q"])
    assert result.exit_code == 2, result.output
    assert says in result.output and "HINT:" in result.output


def test_different_config_on_existing_output_is_refused(ray_cluster, tars, tmp_path):
    tars.make("a.tar", range(3))
    out = str(tmp_path / "out")
    assert run_cli(tars.made[0], "--output", out, "--size", "16").exit_code == 0
    result = runner.invoke(app, ["run", tars.made[0], "--output", out, "--size", "24"])
    assert result.exit_code == 2
    assert "different config" in result.output and "height" in result.output
    assert shardio.open_dataset(out).shape == (16, 16, 3)


def test_every_node_of_the_cluster_processes_inputs_into_one_dataset(ray_cluster, tars, tmp_path):
    # Placement is Ray's business and depends on load (on a busy machine one node can take all 8 inputs even
    # with SPREAD), so the test does not wait for luck: it takes the CPU of one node while a drop runs, then
    # of the other for the next drop. Each node must then process inputs, and one dataset must result.
    import ray

    assert ray_tasks.TASK_OPTIONS["scheduling_strategy"] == "SPREAD"  # what spreads inputs on real clusters
    nodes = sorted(n["NodeID"] for n in ray.nodes() if n["Alive"])
    assert len(nodes) == 2
    out = str(tmp_path / "out")
    used: dict[str, int] = {}
    for drop, busy in enumerate(nodes):
        for t in range(drop * 4, drop * 4 + 4):
            tars.make(f"{t}.tar", range(t * 2, t * 2 + 2), with_meta=False)
        blocker = occupy_node_cpu(busy)
        try:
            report_path = str(tmp_path / f"r{drop}.json")
            result = run_cli(f"{tars.directory}/*.tar", "--output", out, "--size", "16", "--report", report_path)
        finally:
            ray.kill(blocker)
        assert result.exit_code == 0, result.output
        report = json.load(open(report_path))
        assert report["cluster"]["nodes"] == 2
        on = {node.rsplit("/", 1)[-1] for node in report["inputs_per_node"]}
        assert on and not any(busy.startswith(n) for n in on), f"drop {drop} ran on the occupied node: {on}"
        for node, count in report["inputs_per_node"].items():
            used[node] = used.get(node, 0) + count
    assert len(used) == 2 and sum(used.values()) == 8, used
    assert read_all(out)[0] == list(range(16))


def test_a_non_utf8_key_that_is_also_a_bad_sample_is_reported_not_fatal(ray_cluster, tars, tmp_path):
    bad_name = b"bad\xff-000002.jpg".decode("utf-8", "surrogateescape")  # a Latin-1 byte, as tarfile reads it
    path = tars.write("names.tar", [*tars.samples([0, 1]), Member(bad_name, b"not an image")])
    out, report_path = str(tmp_path / "out"), str(tmp_path / "r.json")
    result = run_cli(path, "--output", out, "--size", "16", "--report", report_path)
    assert result.exit_code == 0, result.output
    report = json.loads(open(report_path, encoding="utf-8").read())
    assert report["inputs_processed"] == [path] and report["samples_written"] == 2
    assert [f["key"] for f in report["failures"]] == ["bad\\xff-000002"]
    assert len(os.listdir(os.path.join(out, "reports"))) == 1


def test_the_report_survives_any_content_and_an_error_after_a_commit(ray_cluster, tars, tmp_path):
    # A lone surrogate (a non-UTF-8 name that reached a reason) cannot be UTF-8: ASCII escapes instead.
    report = RunReport(run_id="r", output="o", started="s", config={},
                       failures=[{"input": "a.tar", "key": "k\udcff", "reason": "bad \udcff"}])
    assert json.loads(report_json(report))["failures"][0]["key"] == "k\udcff"
    # An unexpected exception after an input was committed still leaves the commit and a report.
    tars.make("a.tar", range(3))
    out = str(tmp_path / "out")

    def broken_hook(kind, payload):
        if kind == "input":
            raise RuntimeError("a bug in a progress hook")

    cfg = JobConfig(height=16, width=16)
    with pytest.raises(RuntimeError):
        run_job(RunOptions(inputs=[tars.made[0]], output=out, config=cfg), on_event=broken_hook)
    (saved,) = os.listdir(os.path.join(out, "reports"))
    saved_report = json.load(open(os.path.join(out, "reports", saved)))
    assert "stopped by an error: RuntimeError: a bug in a progress hook" in saved_report["warnings"]
    assert saved_report["inputs_processed"] == [tars.made[0]] and saved_report["dataset_samples"] == 3
    assert len(shardio.open_dataset(out)) == 3


# --- mode: bucket --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("encoding", ["raw", "jpeg"])
def test_every_sample_lands_once_in_a_shard_of_its_bucket(ray_cluster, tars, tmp_path, encoding) -> None:
    pattern, samples = make_bucket_tars(tars, [23, 17])
    out = str(tmp_path / "out")
    result = run_bucket_job(pattern, "--output", out, "--encoding", encoding)
    assert result.exit_code == 0, result.output
    per_bucket = check_buckets(out, samples)
    expected: dict[int, int] = {}
    for index in range(samples):
        bucket = nearest_bucket(*SOURCE_SIZES[index % len(SOURCE_SIZES)], JOB_BUCKETS)
        expected[bucket] = expected.get(bucket, 0) + 1
    assert per_bucket == expected and len(expected) >= 4
    # Within an input: one open shard a bucket, full ones of samples_per_shard, the input's last of each
    # bucket partial; file numbers count the input's shards across its buckets.
    state = dataset_state(out)
    names = sorted(os.path.basename(s["path"]) for s in state["shards"])
    assert len(names) == len(set(names))
    # The rerun reads the stored config (the resolved list): nothing to do, nothing changed.
    again = runner.invoke(app, ["run", pattern, "--output", out, "-q"], catch_exceptions=False)
    assert again.exit_code == 0, again.output
    assert dataset_state(out) == state
