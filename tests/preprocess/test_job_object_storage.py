"""The job with its output in a bucket: the commit protocol on a store with no rename, no flock, no fsync.

Against the session's S3 server and Azure emulator (``writable_cloud_bucket``: the job, two writers and
kill -9 run on both; the GCS emulator takes no writes, tests/store/test_clouds.py), and S3 alone for the fault
injection: the same tars give the same bytes in a bucket as on local disk (a yuv420 dataset too, read back
as the local one);
kill -9 at random moments, then a rerun, gives the uninterrupted result with no orphan object; a burst
of 503s and a server restart mid-run are ridden out; two concurrent runs never both commit; refused
credentials and a missing bucket are usage errors within seconds.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import pytest
from typer.testing import CliRunner

from preprocess.cli import app
from shardio.write import directory as dataset_dir
from shardio import errors
from shardio.format import Manifest
from tests.dataset_compare import assert_clean, assert_indices, assert_same_dataset
from tests.fault_proxy import FaultProxy
from tests.preprocess.test_crash_safety import FLAGS, wait_for_dead_runs_tasks
from tests.legacy_format import legacy_doc
from tests.object_stores import CloudBucket

pytestmark = pytest.mark.ray
runner = CliRunner()


def run_cli(*args: str, ray: str):
    return runner.invoke(app, ["run", *args, *FLAGS, "-q", "--ray-address", ray], catch_exceptions=False)


def start_run(pattern: str, out: str, log: str, ray: str | None, env: dict[str, str] | None = None,
              extra: tuple[str, ...] = ()) -> subprocess.Popen:
    args = [sys.executable, "-m", "preprocess.cli", "run", pattern, "--output", out, *FLAGS, "-q", *extra]
    if ray:
        args += ["--ray-address", ray]
    with open(log, "ab") as stderr:
        return subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=stderr, env=env)


def keys(bucket: CloudBucket, prefix: str) -> list[str]:
    return bucket.keys(prefix)


def fetch(bucket: CloudBucket, prefix: str, local: str) -> str:
    """Copy a dataset from the bucket to a local folder, to compare it with the local tools."""
    return bucket.fetch(prefix, local)


def assert_no_orphans(bucket: CloudBucket, prefix: str) -> None:
    """Only what a committed dataset holds: the manifest, generations, reports and listed shards; no lease,
    no probe object."""
    found = keys(bucket, prefix)
    manifest = legacy_doc(bucket.url(prefix))
    listed = {p for s in manifest["shards"] for p in (s["path"], s["meta_path"])}
    retired = {r["path"] for r in manifest.get("retired", [])}
    shards = {k for k in found if k.startswith("shards/")}
    assert shards - retired == listed, f"orphan or missing shard objects: {shards ^ listed}"
    others = [k for k in found
              if not k.startswith(("shards/", "manifests/", "reports/", "index/")) and k != "manifest.json"]
    assert not others, f"left behind: {others}"


def make_inputs(tars, sizes=(30, 12, 25, 9)) -> tuple[str, int]:
    start = 0
    for number, size in enumerate(sizes):
        tars.make(f"{number:02d}.tar", range(start, start + size))
        start += size
    return f"{tars.directory}/*.tar", start


def test_the_same_tars_give_the_same_bytes_in_a_bucket_and_a_rerun_is_a_no_op(
        ray_cluster, writable_cloud_bucket, tars, tmp_path, capsys, monkeypatch):
    bucket = writable_cloud_bucket
    pattern, total = make_inputs(tars)
    local = str(tmp_path / "local")
    assert run_cli(pattern, "--output", local, ray=ray_cluster).exit_code == 0
    url = bucket.url("ds")
    assert run_cli(pattern, "--output", url, ray=ray_cluster).exit_code == 0
    copy = fetch(bucket, "ds", str(tmp_path / "copy"))
    assert_same_dataset(copy, local)
    assert_no_orphans(bucket, "ds")
    before = keys(bucket, "ds/shards")
    result = run_cli(pattern, "--output", url, ray=ray_cluster)
    assert result.exit_code == 0
    assert keys(bucket, "ds/shards") == before
    assert_indices(fetch(bucket, "ds", str(tmp_path / "copy2")), list(range(total)))
    # The training-side CLI on the URL: info reads the manifest and reports by LIST; preview reads pixels
    # through the default cache.
    from shardio.tools.cli import main as shardio_main

    assert shardio_main(["info", url, "--json"]) == 0
    import json

    assert json.loads(capsys.readouterr().out)["samples"] == total
    png = tmp_path / "preview.png"
    monkeypatch.setenv("SHARDIO_CACHE_DIR", str(tmp_path / "cache"))
    assert shardio_main(["preview", url, "--out", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_yuv420_dataset_written_to_a_bucket_has_the_local_bytes_and_reads_back_the_same(
        ray_cluster, s3_server, s3_bucket, tars, tmp_path):
    import torch

    from shardio import ShardDataset

    pattern, total = make_inputs(tars, (20, 14))
    local, url = str(tmp_path / "local"), f"s3://{s3_bucket}/yuv"
    for out in (local, url):
        assert run_cli(pattern, "--output", out, "--encoding", "yuv420", ray=ray_cluster).exit_code == 0
    assert_same_dataset(fetch(CloudBucket(s3_server, s3_bucket), "yuv", str(tmp_path / "copy")), local)
    assert_no_orphans(CloudBucket(s3_server, s3_bucket), "yuv")
    for decode in ("cpu", "device"):  # RGB converted on the CPU, and the planes left for the device
        here = list(ShardDataset(local, 8, shuffle=True, seed=2, decode=decode))
        there = list(ShardDataset(url, 8, shuffle=True, seed=2, decode=decode, cache_dir=str(tmp_path / decode)))
        assert sum(len(b["__key__"]) for b in there) == total and len(here) == len(there)
        for a, b in zip(here, there):
            assert a["__key__"] == b["__key__"]
            pixels = (a["image"].planes, b["image"].planes) if decode == "device" else (a["image"], b["image"])
            assert torch.equal(*pixels)


def test_two_writers_from_the_same_manifest_never_both_commit(writable_cloud_bucket):
    url = writable_cloud_bucket.url("ds")
    first = Manifest(shape=(8, 8, 3), config={}, versions={})
    dataset_dir.commit(url, first)  # a new dataset: created if absent
    a = dataset_dir.load_current(url)
    b = dataset_dir.load_current(url)
    dataset_dir.commit(url, a)
    with pytest.raises(errors.CommitConflict):
        dataset_dir.commit(url, b)  # b read the manifest before a's commit: refused, nothing overwritten
    assert dataset_dir.load_current(url).generation == a.generation
    with pytest.raises(errors.CommitConflict, match="created this dataset first"):
        dataset_dir.commit(url, Manifest(shape=(8, 8, 3), config={}, versions={}))


@pytest.mark.slow
def test_sigkill_at_random_moments_then_rerun_gives_the_uninterrupted_result_and_no_orphans(
        ray_cluster, writable_cloud_bucket, tars, tmp_path):
    bucket = writable_cloud_bucket
    pattern, total = make_inputs(tars, (40, 22, 35, 9, 30))
    log = str(tmp_path / "runs.log")
    reference = str(tmp_path / "reference")
    assert run_cli(pattern, "--output", reference, ray=ray_cluster).exit_code == 0
    rng = random.Random(20261123)
    outcomes = []
    for attempt in range(3):
        prefix = f"k{attempt}"
        url = bucket.url(prefix)
        run = start_run(pattern, url, log, ray_cluster)
        began, first_upload = time.monotonic(), None
        delay = rng.uniform(0.0, 2.5)
        while run.poll() is None:
            if first_upload is None and keys(bucket, f"{prefix}/shards"):
                first_upload = time.monotonic()
            if first_upload is not None and time.monotonic() >= first_upload + delay:
                run.send_signal(signal.SIGKILL)  # mid-upload, mid-commit or just after
                break
            if time.monotonic() - began > 120:
                break
            time.sleep(0.01)
        run.wait()
        outcomes.append((round(delay, 2), run.returncode))
        wait_for_dead_runs_tasks()
        assert run_cli(pattern, "--output", url, ray=ray_cluster).exit_code == 0, open(log).read()[-2000:]
        copy = fetch(bucket, prefix, str(tmp_path / f"copy{attempt}"))
        assert_same_dataset(copy, reference)
        assert_clean(copy)
        assert_no_orphans(bucket, prefix)
    print("kills (delay after first upload, exit):", outcomes)


def run_through(proxy: FaultProxy, pattern: str, url: str, tmp_path) -> tuple[subprocess.Popen, str]:
    """A run whose every request (its own local Ray's workers' too) goes through ``proxy``; returns once
    it has uploaded its first shard."""
    env = dict(os.environ, AWS_ENDPOINT_URL=proxy.endpoint)
    env.pop("RAY_ADDRESS", None)
    log = str(tmp_path / "run.log")
    run = start_run(pattern, url, log, None, env=env, extra=("--workers", "1"))
    deadline = time.monotonic() + 180
    while run.poll() is None and not any(m.startswith("PUT") and "/shards/" in m for m in proxy.methods):
        assert time.monotonic() < deadline, "no shard upload seen"
        time.sleep(0.01)
    return run, log


def test_a_burst_of_503_slowdown_is_retried_and_the_result_is_exact(s3_server, s3_bucket, tars, tmp_path):
    pattern, total = make_inputs(tars, (20, 14))
    proxy = FaultProxy(s3_server.ports["s3"])
    try:
        proxy.fail_next(5)  # the run's first requests (probe, lease, manifest) meet SlowDown
        run, log = run_through(proxy, pattern, f"s3://{s3_bucket}/ds", tmp_path)
        proxy.fail_next(4, status=500)  # and a burst in the middle of the uploads
        assert run.wait(300) == 0, open(log).read()[-3000:]
        assert proxy.failed >= 5
    finally:
        proxy.close()
    assert_indices(fetch(CloudBucket(s3_server, s3_bucket), "ds", str(tmp_path / "copy")), list(range(total)))
    assert_no_orphans(CloudBucket(s3_server, s3_bucket), "ds")


def test_the_store_going_away_mid_run_is_ridden_out(s3_server, s3_bucket, tars, tmp_path):
    # The endpoint's port closes for 3 s while shards upload (connections refused, as while a server
    # restarts), then comes back. Restarting SeaweedFS itself takes 3 s to over 60 s here (raft election,
    # volume re-registration), too unpredictable for the suite; the client sees the same refused connections.
    pattern, total = make_inputs(tars, (30, 20, 25))
    proxy = FaultProxy(s3_server.ports["s3"])
    try:
        run, log = run_through(proxy, pattern, f"s3://{s3_bucket}/ds", tmp_path)
        proxy.go_down()
        try:
            time.sleep(3.0)
        finally:
            proxy.come_back()
        assert run.wait(300) == 0, open(log).read()[-3000:]
    finally:
        proxy.close()
    assert_indices(fetch(CloudBucket(s3_server, s3_bucket), "ds", str(tmp_path / "copy")), list(range(total)))
    assert_no_orphans(CloudBucket(s3_server, s3_bucket), "ds")


def test_a_second_run_on_a_busy_output_exits_2_and_the_first_commits(ray_cluster, writable_cloud_bucket, tars,
                                                                     tmp_path):
    from tests.interrupt_helpers import config_file, slow_inputs

    bucket = writable_cloud_bucket
    slow_inputs(tars, 6)
    url = bucket.url("ds")
    log = str(tmp_path / "first.log")
    with open(log, "ab") as stderr:
        first = subprocess.Popen([sys.executable, "-m", "preprocess.cli", "run", f"{tars.directory}/*.tar",
                                  "--output", url, "--config", config_file(str(tmp_path)), "-q", "--ray-address",
                                  ray_cluster], stdout=subprocess.DEVNULL, stderr=stderr)
    deadline = time.monotonic() + 120
    while ".lock" not in keys(bucket, "ds"):
        assert first.poll() is None and time.monotonic() < deadline, open(log).read()
        time.sleep(0.01)
    second = runner.invoke(app, ["run", f"{tars.directory}/*.tar", "--output", url, "--config",
                                 config_file(str(tmp_path)), "-q", "--ray-address", ray_cluster])
    assert second.exit_code == 2, second.output
    assert "another run is writing this output" in " ".join(second.output.split())
    assert first.wait(300) == 0, open(log).read()
    assert_no_orphans(bucket, "ds")


@pytest.mark.parametrize("problem", ["credentials", "bucket"])
def test_refused_credentials_and_a_missing_bucket_are_usage_errors_within_seconds(problem, s3_server, tars, tmp_path):
    tars.make("a.tar", range(3))
    env = dict(os.environ)
    out = "s3://no-such-bucket-x/ds"
    if problem == "credentials":
        env["AWS_SECRET_ACCESS_KEY"] = "wrong"
        out = f"s3://{s3_server.new_bucket()}/ds"
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "preprocess.cli", "run", tars.made[0], "--output", out, "-q"],
                            capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 2, result.stderr
    message = " ".join(result.stderr.split())
    assert out in message
    assert ("403" in message and "credentials" in message) if problem == "credentials" else \
        "bucket 'no-such-bucket-x' does not exist" in message
    assert time.monotonic() - started < 30  # no minute of retries (most of this is Python start-up)
    assert not os.path.exists("s3:")
