"""``replicas:`` without Ray: the option checked and resolved against the cluster's GPUs, and what one replica
does (``ReplicaCore``): batches full across inputs, a short batch only once no queued input can fill it, a
replaced attempt forgotten, a raising batch failing exactly its inputs, a broken contract breaking every input."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from preprocess.config import JobConfig
from preprocess.models.model_config import ModelSpec, parse_models
from preprocess.models.outputs import ModelOutputs
from preprocess.models.replica_core import STALE, ReplicaCore
from preprocess.models.replicas import replica_counts
from shardio.errors import ConfigError, InputError
from tests.preprocess.models.toy_models import caption_hash

TOY = "tests.preprocess.models.toy_models"
JOB = "tests.preprocess.models.job_models"


# --- the option -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("replicas", "words"), [
    (-1, "models: latent: replicas must be auto or an integer >= 0 (0: the model runs in each input's task), got -1"),
    ("two", "replicas must be auto or an integer >= 0 (0: the model runs in each input's task), got 'two'"),
    (True, "replicas must be auto or an integer >= 0"),
    (1.5, "replicas must be auto or an integer >= 0"),
    ("2", "replicas must be auto or an integer >= 0"),
    (None, "replicas must be auto or an integer >= 0"),
])
def test_a_bad_replicas_is_refused_naming_the_output_and_the_key(replicas, words):
    with pytest.raises(ConfigError) as caught:
        parse_models({"latent": {"fn": "m:f", "replicas": replicas}})
    assert words in str(caught.value)


def test_replicas_with_a_pinned_gpu_is_refused_saying_what_to_use():
    with pytest.raises(ConfigError, match="models: latent: device cuda:1 names one GPU, but replicas run on the GPUs "
                                          "Ray gives them: use device: cuda with replicas: 2, or replicas: 0"):
        parse_models({"latent": {"fn": "m:f", "device": "cuda:1", "replicas": 2}})
    for replicas in ("auto", 0):  # a pinned GPU runs in the tasks, as before
        assert parse_models({"latent": {"fn": "m:f", "device": "cuda:1", "replicas": replicas}})[0].device == "cuda:1"


@pytest.mark.parametrize("replicas", ["auto", 0, 1, 8])
def test_replicas_is_how_a_model_runs_not_what_it_stores(replicas):
    (spec,) = parse_models({"latent": {"fn": "m:f", "replicas": replicas}})
    assert spec.replicas == replicas and spec.to_dict()["replicas"] == replicas
    assert "replicas" not in spec.output_dict()
    cfg = JobConfig(models={"latent": {"fn": "m:f", "replicas": replicas}})
    assert cfg.output_dict() == JobConfig(models={"latent": "m:f"}).output_dict()  # a rerun may change it
    assert JobConfig(**cfg.to_dict()).model_specs == cfg.model_specs  # what a task rebuilds


def test_the_default_is_auto():
    assert ModelSpec(name="latent", fn="m:f").replicas == "auto"


@pytest.mark.parametrize(("device", "replicas", "gpus", "count", "on_gpu"), [
    ("auto", "auto", 0, 0, False),  # no GPU: in the tasks, as before
    ("auto", "auto", 4, 4, True),  # one replica per GPU
    ("cuda", "auto", 2, 2, True),
    ("cpu", "auto", 4, 0, False),  # a CPU model stays in the tasks on a GPU cluster
    ("cuda:1", "auto", 4, 0, False),  # a pinned GPU: in the tasks
    ("auto", 0, 4, 0, True),
    ("auto", 2, 0, 2, False),  # an explicit count runs even on the CPU
    ("cpu", 3, 4, 3, False),
    ("cuda", 1, 4, 1, True),
])
def test_replica_count_follows_the_device_and_the_clusters_gpus(device, replicas, gpus, count, on_gpu):
    spec = ModelSpec(name="latent", fn="m:f", device=device, replicas=replicas)
    assert spec.replica_count(gpus) == count and spec.runs_on_gpu(gpus) == on_gpu
    assert replica_counts([spec], gpus) == ({"latent": count} if count else {})


def test_more_gpu_replicas_than_gpus_or_a_gpu_where_there_is_none_is_refused():
    with pytest.raises(ConfigError, match=r"models: latent: replicas: 3 on the GPU, but the Ray cluster has 2 "
                                          r"GPU\(s\)"):
        replica_counts([ModelSpec(name="latent", fn="m:f", replicas=3)], 2)
    with pytest.raises(ConfigError, match="models: latent: device cuda with replicas: 1, but the Ray cluster has no "
                                          "GPU: use device: auto or cpu"):
        replica_counts([ModelSpec(name="latent", fn="m:f", device="cuda", replicas=1)], 0)


# --- one replica, without Ray ------------------------------------------------------------------------------------

def logged_core(tmp_path, batch_size: int = 8, fn: str = f"{JOB}:make_batch_logged_text"):
    log = tmp_path / "batches.log"
    spec = ModelSpec(name="text", fn=fn, input="text", batch_size=batch_size, device="cpu")
    return ReplicaCore([spec], torch.device("cpu")), log


def captions(log, input: str, count: int) -> list[str]:
    return [f"LOG={log}|{input} {i}" for i in range(count)]


def batches(log) -> list[int]:
    return [int(line) for line in log.read_text().split()] if log.exists() else []


def add_all(core: ReplicaCore, input: str, attempt: int, texts: list[str]):
    return core.add("text", input, attempt, list(range(len(texts))), texts, [0] * len(texts))


def test_batches_fill_across_inputs_and_the_rest_runs_once_no_queued_input_can_fill_it(tmp_path):
    core, log = logged_core(tmp_path)
    attempts = {name: core.begin("text", name) for name in ("a", "b", "c")}
    texts = {name: captions(log, name, 5) for name in attempts}
    for name in ("a", "b", "c"):  # 5 + 5 fills a batch of 8 at once; 2 + 5 wait
        assert add_all(core, name, attempts[name], texts[name]) is None
    assert batches(log) == [8]
    core.end("text", "a", attempts["a"])
    assert core.ready("text", "a", attempts["a"])  # its samples went in the full batch
    core.end("text", "b", attempts["b"])
    assert batches(log) == [8] and not core.ready("text", "b", attempts["b"]), "c may still fill the batch"
    core.end("text", "c", attempts["c"])
    assert batches(log) == [8, 7]
    for name in ("a", "b", "c"):
        out = core.take("text", name, attempts[name])
        assert isinstance(out, ModelOutputs) and out.failure is None and out.indices == [0, 1, 2, 3, 4]
        np.testing.assert_array_equal(np.stack(out.values), caption_hash(texts[name]).numpy())
    assert core.dtype("text") == "float32"


def test_an_input_begun_holds_the_short_batch_back_until_it_ends_even_with_nothing_queued(tmp_path):
    core, log = logged_core(tmp_path)
    a = core.begin("text", "a")
    b = core.begin("text", "b")  # its task runs: its next chunk may fill a's batch
    add_all(core, "a", a, captions(log, "a", 3))
    core.end("text", "a", a)
    assert batches(log) == [] and not core.ready("text", "a", a)
    add_all(core, "b", b, captions(log, "b", 6))
    assert batches(log) == [8] and core.ready("text", "a", a)  # a's samples went in b's full batch
    core.end("text", "b", b)
    assert batches(log) == [8, 1] and core.take("text", "b", b).indices == list(range(6))


def test_an_input_ending_alone_runs_its_short_batch_at_once(tmp_path):
    core, log = logged_core(tmp_path)
    a = core.begin("text", "a")
    add_all(core, "a", a, captions(log, "a", 3))
    core.end("text", "a", a)
    assert batches(log) == [3] and core.ready("text", "a", a)
    b = core.begin("text", "b")  # a later input never holds back a batch that ran
    add_all(core, "b", b, captions(log, "b", 2))
    assert core.take("text", "a", a).indices == [0, 1, 2] and not core.ready("text", "b", b)


def test_a_new_attempt_forgets_the_old_ones_samples_and_ignores_its_late_chunks(tmp_path):
    core, log = logged_core(tmp_path)
    old = core.begin("text", "a")
    add_all(core, "a", old, captions(log, "a", 3))
    other = core.begin("text", "b")
    add_all(core, "b", other, captions(log, "b", 2))
    core.end("text", "b", other)
    assert not core.ready("text", "b", other), "a's queued samples may still fill the batch"
    new = core.begin("text", "a")  # Ray retried a's task: the old samples go
    assert add_all(core, "a", old, captions(log, "a", 3)) is None  # a late chunk of the dead attempt
    assert core.take("text", "a", old) == STALE
    add_all(core, "a", new, captions(log, "a", 4))
    assert batches(log) == [] and not core.ready("text", "b", other)
    core.end("text", "a", new)
    assert batches(log) == [6], "b's 2 and the new attempt's 4, none of the old attempt's"
    assert core.take("text", "a", new).indices == [0, 1, 2, 3] and core.take("text", "b", other).indices == [0, 1]


def test_dropping_an_input_whose_task_is_gone_lets_the_others_batch_run(tmp_path):
    core, log = logged_core(tmp_path)
    a, b = core.begin("text", "a"), core.begin("text", "b")
    add_all(core, "a", a, captions(log, "a", 2))
    add_all(core, "b", b, captions(log, "b", 2))
    core.end("text", "b", b)
    assert batches(log) == []
    core.drop("a")
    assert batches(log) == [2] and core.take("text", "b", b).indices == [0, 1]
    assert core.take("text", "a", a) == STALE


def test_a_raising_batch_fails_exactly_the_inputs_it_held(tmp_path):
    spec = ModelSpec(name="text", fn=f"{JOB}:make_fragile_text", input="text", batch_size=4, device="cpu")
    core = ReplicaCore([spec], torch.device("cpu"))
    a, b, c = (core.begin("text", name) for name in "abc")
    assert add_all(core, "a", a, ["one", "two"]) is None
    failure = add_all(core, "b", b, ["explode", "three"])  # a's 2 + b's 2: the batch raises
    assert isinstance(failure, InputError) and failure.input == "b" and not failure.lasting
    assert "exploded" in failure.reason and "inputs a, b" in failure.reason
    assert add_all(core, "c", c, ["four"]) is None
    for name, attempt in (("a", a), ("b", b), ("c", c)):
        core.end("text", name, attempt)
    outcomes = {name: core.take("text", name, attempt) for name, attempt in (("a", a), ("b", b), ("c", c))}
    assert outcomes["a"].failure is not None and outcomes["b"].failure is not None
    assert outcomes["c"].failure is None and outcomes["c"].indices == [0]


def test_a_broken_contract_answers_every_input_with_the_same_config_error(tmp_path):
    spec = ModelSpec(name="text", fn=f"{JOB}:make_one_short_text", input="text", batch_size=2, device="cpu")
    core = ReplicaCore([spec], torch.device("cpu"))
    a, b = core.begin("text", "a"), core.begin("text", "b")
    broken = add_all(core, "a", a, ["one", "two"])
    assert isinstance(broken, ConfigError)
    assert str(broken) == ("models: text: the model returned [1, 8] for a batch of 2 samples: the first dimension "
                           "must be 2")
    assert add_all(core, "b", b, ["three"]) is broken
    core.end("text", "b", b)
    assert core.ready("text", "b", b) and core.take("text", "b", b) is broken


def test_a_replica_reports_the_identity_of_the_model_it_loaded():
    from preprocess.models.identity import weights_digest
    from tests.preprocess.models.toy_models import LatentNet

    spec = ModelSpec(name="latent", fn=f"{TOY}:make_latent", device="cpu")
    core = ReplicaCore([spec], torch.device("cpu"))
    assert core.identities == {"latent": {"function": f"{TOY}:make_latent", "weights": weights_digest(LatentNet()),
                                          "version": None}}
