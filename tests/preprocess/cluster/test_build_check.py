"""One build across the cluster: every node's pixel libraries are checked against the driver's before any
task (a real probe task pinned to each node of the 2-node test cluster), a node that differs is named and
the run refused (exit 2), and the manifest records the versions the workers ran with."""

from __future__ import annotations

import json
import os
import platform

import pytest
import ray
from typer.testing import CliRunner

from preprocess import job
from preprocess.image import versions
from preprocess.cluster import ray_cluster as cluster  # the name ray_cluster is the fixture's
from preprocess.cli import app
from preprocess.job import _check_worker_build
from preprocess.worker import InputResult
from shardio.errors import NodeBuildMismatch

pytestmark = pytest.mark.ray
runner = CliRunner()


def _other_node() -> str:
    """The node the driver is not on (the driver runs on the head)."""
    here = ray.get_runtime_context().get_node_id()
    others = [n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeID"] != here]
    assert len(others) == 1
    return others[0]


def _probe_skewed_on(node_id: str):
    """The real probe, except that on ``node_id`` it reports another libjpeg-turbo (as a node with another
    build would). A closure: Ray ships it by value to the node it runs on."""
    real = versions.pixel_build

    def probe() -> dict:
        build = real()
        if ray.get_runtime_context().get_node_id() == node_id:
            build["libjpeg_turbo"] = "9.9.9"
        return build

    return probe


def test_every_node_is_probed_on_the_node_itself(ray_cluster):
    answers = cluster.check_cluster_build()
    ids = sorted(name.rsplit("/", 1)[-1] for name in answers)
    assert ids == sorted(n["NodeID"][:8] for n in ray.nodes() if n["Alive"])
    assert all(build == versions.pixel_build() for build in answers.values())


def _probe_reporting(name: str):
    """The real probe, plus the value of the environment variable ``name`` where it ran."""
    real = versions.pixel_build

    def probe() -> dict:
        return {**real(), name: os.environ.get(name)}

    return probe


def test_the_probe_runs_in_the_tasks_environment(ray_cluster):
    """The tasks' environment (an object-store run's settings): Ray keeps a worker per environment, so the
    probe's worker is then the tasks' own instead of one more started for it."""
    answers = cluster.check_cluster_build(_probe_reporting("SHARDIO_PROBE_ENV"), env={"SHARDIO_PROBE_ENV": "tasks"})
    assert len(answers) == 2 and all(build["SHARDIO_PROBE_ENV"] == "tasks" for build in answers.values())


def test_a_node_with_another_build_is_named_and_refused(ray_cluster):
    other = _other_node()
    with pytest.raises(NodeBuildMismatch) as caught:
        cluster.check_cluster_build(_probe_skewed_on(other))
    message = str(caught.value)
    assert f"/{other[:8]}: libjpeg_turbo 9.9.9 (driver: {versions.pixel_build()['libjpeg_turbo']})" in message
    assert "1 of 2 Ray node(s)" in message
    here = ray.get_runtime_context().get_node_id()
    assert here[:8] not in message  # the node that agrees is not blamed


def test_the_job_refuses_a_mixed_cluster_with_exit_2_before_any_task(ray_cluster, tars, tmp_path, monkeypatch):
    monkeypatch.setattr(cluster, "pixel_build", _probe_skewed_on(_other_node()))
    tars.make("a.tar", range(3), with_meta=False)
    out = str(tmp_path / "out")
    result = runner.invoke(app, ["run", f"{tars.directory}/*.tar", "--output", out, "--size", "16", "-q"],
                           catch_exceptions=False)
    assert result.exit_code == 2, result.output
    said = " ".join(result.output.split())  # the CLI wraps long lines
    assert "libjpeg_turbo 9.9.9" in said and "Nothing was processed" in said
    shards = os.path.join(out, "shards")
    assert not os.path.isdir(shards) or os.listdir(shards) == []


def test_the_manifest_records_the_workers_versions_not_the_drivers(ray_cluster, tars, tmp_path, monkeypatch):
    real = versions.library_versions
    monkeypatch.setattr(job, "library_versions", lambda: {**real(), "python": "driver-only"})
    tars.make("a.tar", range(3), with_meta=False)
    out = str(tmp_path / "out")
    result = runner.invoke(app, ["run", f"{tars.directory}/*.tar", "--output", out, "--size", "16", "-q"],
                           catch_exceptions=False)
    assert result.exit_code == 0, result.output
    with open(os.path.join(out, "manifest.json")) as f:
        recorded = json.load(f)["versions"]
    assert recorded["python"] == platform.python_version()  # a worker's, not the driver's stand-in
    assert {k: recorded[k] for k in versions.PIXEL_LIBRARIES} == versions.pixel_build()


def test_a_result_from_a_node_with_another_build_is_not_committed():
    expected = versions.pixel_build()
    result = InputResult(input="a.tar", size=1, mtime_ns=1, samples=3, shards=[{"path": "shards/x.npy"}],
                         node="late/abcd1234", versions={**versions.library_versions(), "pillow_simd": False})
    _check_worker_build(result, {**expected, "pillow_simd": True})
    assert result.error is not None and "late/abcd1234" in result.error and "pillow_simd False" in result.error
    assert result.shards == []
