"""``models:`` with ``replicas:`` through the job (Ray): the models run in Ray actors fed by the tasks, and the
dataset is the one the tasks' own models write, byte for byte; one replica batches the samples of several
inputs together; a task Ray runs again after its worker died gives the replica its samples once; a broken
contract stops the run with the tasks' message (a raising batch failing its input only is in
test_job_models.py, with and without replicas); a run that ends, however, kills its replicas. On this cluster
(no GPU) ``replicas: auto`` is 0: the tests ask for replicas explicitly."""

from __future__ import annotations

import json
import os

import pytest
import ray

from preprocess.models.model_config import ModelSpec
from preprocess.models.replicas import ModelReplica, ReplicaFeed
from shardio.format.manifests import load_manifest
from tests.bucket_jobs import BUCKET_FLAGS
from tests.dataset_compare import assert_clean, assert_same_dataset
from tests.preprocess.test_job_models import JOB, LATENT, TOY, check_outputs, make_tars, root_of, run, write_config

pytestmark = pytest.mark.ray

TEXT = {"fn": f"{TOY}:make_text", "input": "text", "batch_size": 4}


def models(replicas: int) -> dict:
    return {"latent": {**LATENT, "replicas": replicas}, "text": {**TEXT, "replicas": replicas}}


def spy_kills(monkeypatch) -> list:
    """The replicas ray.kill is called on (then called through)."""
    from preprocess.models import replicas

    killed, kill = [], ray.kill
    monkeypatch.setattr(replicas.ray, "kill", lambda actor, **kw: (killed.append(actor), kill(actor, **kw)))
    return killed


def test_outputs_from_two_replicas_are_the_bytes_the_tasks_write(ray_cluster, tars, tmp_path, monkeypatch):
    killed = spy_kills(monkeypatch)
    pattern = make_tars(tars, [7, 5, 3])
    in_tasks, in_replicas = str(tmp_path / "tasks"), str(tmp_path / "replicas")
    report = str(tmp_path / "report.json")
    result = run(pattern, "--output", in_tasks, "--config", write_config(tmp_path / "0.yaml", models(0)),
                 *BUCKET_FLAGS)
    assert result.exit_code == 0, result.output
    result = run(pattern, "--output", in_replicas, "--config", write_config(tmp_path / "2.yaml", models(2)),
                 *BUCKET_FLAGS, "--report", report)
    assert result.exit_code == 0, result.output
    assert json.load(open(report))["cluster"]["model_replicas"] == {"latent": 2, "text": 2}
    assert_same_dataset(in_replicas, in_tasks)
    assert root_of(in_replicas)["outputs"] == root_of(in_tasks)["outputs"]
    assert check_outputs(in_replicas) == 15
    assert_clean(in_replicas)
    assert len(killed) == 2, "a replica outlived its run"


def test_a_rerun_with_replicas_appends_to_a_dataset_the_tasks_made(ray_cluster, tars, tmp_path):
    """``replicas`` is how a model runs, not what it stores: another value on a rerun is the same dataset; one
    model in a replica and the other in the tasks is a run like any other."""
    pattern = make_tars(tars, [4])
    out = str(tmp_path / "out")
    flags = ["--size", "16", "--samples-per-shard", "3"]
    result = run(pattern, "--output", out, "--config", write_config(tmp_path / "0.yaml", models(0)), *flags)
    assert result.exit_code == 0, result.output
    make_tars(tars, [3], first=4, names=["01.tar"])
    mixed = {"latent": {**LATENT, "replicas": 1}, "text": {**TEXT, "replicas": 0}}
    result = run(pattern, "--output", out, "--config", write_config(tmp_path / "1.yaml", mixed), *flags)
    assert result.exit_code == 0, result.output
    assert check_outputs(out) == 7
    assert_clean(out)


def test_a_task_retried_after_its_worker_died_gives_its_replica_its_samples_once(ray_cluster, tars, tmp_path,
                                                                                 monkeypatch):
    """The worker dies after sending 64 samples of the big input; Ray runs the task again, which begins a new
    attempt on the replica: the old attempt's queued samples are forgotten and its late chunks ignored, so the
    outputs are the tasks' own, byte for byte."""
    from preprocess.cluster import ray_tasks

    pattern = make_tars(tars, [70, 5])
    flags = ["--size", "16", "--samples-per-shard", "16"]
    reference, out = str(tmp_path / "reference"), str(tmp_path / "out")
    result = run(pattern, "--output", reference, "--config", write_config(tmp_path / "0.yaml", models(0)), *flags)
    assert result.exit_code == 0, result.output
    real_task, marker = ray_tasks._task, str(tmp_path / "died-once")

    def task_whose_worker_dies_once(input_path, *args, **kwargs):
        for number, message in enumerate(real_task(input_path, *args, **kwargs)):
            yield message
            if number == 2 and input_path.endswith("00.tar") and not os.path.exists(marker):  # 64 samples sent
                open(marker, "w").close()
                os._exit(1)

    monkeypatch.setattr(ray_tasks, "_task", task_whose_worker_dies_once)
    result = run(pattern, "--output", out, "--config", write_config(tmp_path / "1.yaml", models(1)), *flags)
    assert result.exit_code == 0, result.output
    assert os.path.exists(marker), "the worker never died: the test did not test anything"
    assert_same_dataset(out, reference)
    assert check_outputs(out) == 75
    assert_clean(out)


def batch_sizes(log) -> list[int]:
    return sorted(int(line) for line in log.read_text().split())


@pytest.mark.parametrize("replicas", [0, 1])
def test_every_sample_goes_through_the_model_once_in_batches_no_larger_than_asked(replicas, ray_cluster, tars,
                                                                                 tmp_path):
    log = tmp_path / "batches.log"
    pattern = make_tars(tars, [5, 5, 5], caption=lambda index: f"LOG={log}|caption {index}")
    config = write_config(tmp_path / "c.yaml", {"text": {"fn": f"{JOB}:make_batch_logged_text", "input": "text",
                                                         "batch_size": 8, "replicas": replicas}})
    out = str(tmp_path / "out")
    result = run(pattern, "--output", out, "--config", config, "--size", "16", "--samples-per-shard", "4")
    assert result.exit_code == 0, result.output
    sizes = batch_sizes(log)
    assert sum(sizes) == 15 and max(sizes) <= 8
    if replicas == 0:
        assert sizes == [5, 5, 5]  # each task batches its own input alone
    # With one replica the batches depend on how the three tasks overlap (two CPUs here): the replica itself
    # is checked below with an order fixed by the test.
    assert sum(s.samples for s in load_manifest(out).shards) == 15


def test_one_replica_batches_three_inputs_together(ray_cluster, tmp_path):
    """Three inputs of 5, batches of 8, one replica: two calls, [8, 7], where the tasks alone make three of 5.
    The feeds are driven from here, in a fixed order (each input's samples sent, then each ended)."""
    log = tmp_path / "batches.log"
    spec = ModelSpec(name="text", fn=f"{JOB}:make_batch_logged_text", input="text", batch_size=8, replicas=1)
    replica = ray.remote(ModelReplica).options(num_cpus=0).remote([spec.to_dict() | {"name": "text"}], False)
    try:
        assert "text" in ray.get(replica.ready.remote())
        feeds = {name: ReplicaFeed(replica, "text", name) for name in ("a", "b", "c")}
        for name, feed in feeds.items():
            for index in range(5):
                feed.add(index, f"LOG={log}|{name} {index}", 0)
            feed._send()
            ray.get(feed._in_flight)  # this input's samples are queued before the next one's
        for feed in feeds.values():
            feed.end()
        outputs = {name: feed.take() for name, feed in feeds.items()}
    finally:
        ray.kill(replica)
    assert batch_sizes(log) == [7, 8]
    assert all(o.indices == [0, 1, 2, 3, 4] and o.failure is None for o in outputs.values())
    assert feeds["a"].identity == {"function": spec.fn, "weights": None, "version": "batch-logged-caption-hash-1"}
    assert feeds["a"].dtype == "float32"


def error_lines(output: str) -> list[str]:
    return [line for line in " ".join(output.split()).split("error: ")[1:]]


def test_a_model_breaking_its_contract_in_a_replica_stops_the_run_as_in_a_task(ray_cluster, tars, tmp_path,
                                                                               monkeypatch):
    killed = spy_kills(monkeypatch)
    pattern = make_tars(tars, [3, 3])
    flags = ["--size", "16", "--samples-per-shard", "2"]
    outputs = {}
    for replicas in (0, 2):
        broken = write_config(tmp_path / f"{replicas}.yaml", {"text": {"fn": f"{JOB}:make_one_short_text",
                                                                       "input": "text", "replicas": replicas}})
        out = str(tmp_path / f"out{replicas}")
        result = run(pattern, "--output", out, "--config", broken, *flags)
        assert result.exit_code == 2, result.output
        outputs[replicas] = error_lines(result.output)
        assert not os.path.exists(os.path.join(out, "manifest.json")) or load_manifest(out).shards == []
        (saved,) = os.listdir(os.path.join(out, "reports"))
        # Nothing remembered as failed: the run with a mended model takes every input.
        assert json.load(open(os.path.join(out, "reports", saved)))["inputs_failed"] == []
    assert outputs[2] == outputs[0] and outputs[0], outputs
    assert len(killed) == 2, "a replica outlived the run it stopped"
    assert "models: text: the model returned [2, 8] for a batch of 3 samples" in outputs[0][0]


def test_a_bad_replicas_is_refused_before_anything_is_touched(tars, tmp_path):
    pattern = make_tars(tars, [2])
    config = write_config(tmp_path / "c.yaml", {"latent": {**LATENT, "replicas": -2}})
    out = str(tmp_path / "out")
    result = run(pattern, "--output", out, "--config", config)
    assert result.exit_code == 2
    assert "models: latent: replicas must be auto or an integer >= 0" in " ".join(result.output.split())
    assert not os.path.exists(out)


def test_a_run_stopped_early_kills_its_replicas(ray_cluster, tars, tmp_path, monkeypatch):
    from preprocess.config import JobConfig
    from preprocess.job import RunOptions, run_job

    killed = spy_kills(monkeypatch)
    pattern = make_tars(tars, [3, 3, 3, 3])
    out, stop = str(tmp_path / "out"), {"why": ""}

    def on_event(kind, payload):
        if kind == "input":  # the first input finished: stop as Ctrl-C does
            stop["why"] = "SIGINT"

    cfg = JobConfig(height=16, width=16, samples_per_shard=4, models=models(1))
    report = run_job(RunOptions(inputs=[pattern], output=out, config=cfg), on_event, lambda: stop["why"])
    assert report.interrupted == "SIGINT" and report.inputs_processed
    assert len(killed) == 1, "the replica outlived its stopped run"
    assert check_outputs(out) == 3 * len(report.inputs_processed)
    # A cancelled task may still have written its files: the next run's cleaning removes them.
    again = run_job(RunOptions(inputs=[pattern], output=out, config=cfg))
    assert not again.interrupted and not again.inputs_failed and len(killed) == 2
    assert check_outputs(out) == 12
    assert_clean(out)
