"""``models:`` through the job (Ray): each shard's output files hold the model applied to the samples as the
reader yields them (per bucket, single shape, a JPEG dataset's decoded pixels, a text model on the captions), the
root records each output's dtype, shapes and model identity (format version 6), a rerun runs the models on the
new inputs only, a changed model is refused before anything is touched, and a model raising fails its input
only."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import yaml
from typer.testing import CliRunner

from preprocess.cli import app
from preprocess.models.identity import weights_digest
from shardio.format.manifests import load_manifest
from shardio.format.model_outputs import output_path
from shardio.read.jpeg_pixels import map_jpeg_shard
from shardio.store.checksum import WRITE_ALGORITHM, file_checksum
from tests.bucket_jobs import BUCKET_FLAGS, JOB_BUCKETS, SOURCE_SIZES
from tests.dataset_compare import assert_clean, assert_same_dataset, dataset_state
from tests.preprocess.models import job_models
from tests.preprocess.models.toy_models import LatentNet, caption_hash, latent_of
from tests.tar_factory import Member, index_image, jpeg_bytes

pytestmark = pytest.mark.ray
runner = CliRunner()

TOY = "tests.preprocess.models.toy_models"
JOB = "tests.preprocess.models.job_models"
LATENT = {"fn": f"{TOY}:make_latent", "batch_size": 3, "device": "cpu"}


def write_config(path, models: dict) -> str:
    with open(path, "w", encoding="utf-8") as f:
        yaml.safe_dump({"models": models}, f)
    return str(path)


def make_tars(tars, counts: list[int], caption=lambda index: f"caption {index}", first: int = 0,
              names: list[str] | None = None) -> str:
    """Tars of captioned JPEGs of the bucketed tests' six aspect ratios; their pattern."""
    start = first
    for number, count in enumerate(counts):
        members = []
        for index in range(start, start + count):
            width, height = SOURCE_SIZES[index % len(SOURCE_SIZES)]
            members += [Member(f"{index:06d}.jpg", jpeg_bytes(index_image(index, width, height))),
                        Member(f"{index:06d}.txt", caption(index).encode())]
        tars.write((names or [f"{n:02d}.tar" for n in range(len(counts))])[number], members)
        start += count
    return f"{tars.directory}/*.tar"


def run(*args: str):
    return runner.invoke(app, ["run", *args, "-q"], catch_exceptions=False)


def root_of(out: str) -> dict:
    with open(os.path.join(out, "manifest.json"), encoding="utf-8") as f:
        return json.load(f)


def shard_rows(out: str, encoding: str = "raw"):
    """(shard entry, its stored pixels as the reader yields them, its captions) of every shard."""
    manifest = load_manifest(out)
    for shard in manifest.shards:
        path = os.path.join(out, shard.path)
        if encoding == "jpeg":
            h, w = manifest.buckets[shard.bucket] if manifest.buckets else manifest.shape[:2]
            pixels = map_jpeg_shard(shard.path, path, shard.samples, h, w).decode()
        else:
            pixels = np.load(path)
        with open(os.path.join(out, shard.meta_path), encoding="utf-8") as f:
            captions = [json.loads(line)["txt"] for line in f]
        yield shard, pixels, captions


def check_outputs(out: str, encoding: str = "raw") -> int:
    """Every shard's output files: the models applied to its samples, digests as the index lists; samples."""
    samples = 0
    for shard, pixels, captions in shard_rows(out, encoding):
        latent = np.load(os.path.join(out, output_path(shard.path, "latent")))
        text = np.load(os.path.join(out, output_path(shard.path, "text")))
        assert latent.dtype == np.float16 and text.dtype == np.float32
        assert len(latent) == len(text) == shard.samples == len(pixels)
        for row, sample in enumerate(pixels):
            np.testing.assert_array_equal(latent[row], latent_of(sample))
        np.testing.assert_array_equal(text, caption_hash(captions).numpy())
        assert shard.outputs == tuple(file_checksum(os.path.join(out, output_path(shard.path, name)), WRITE_ALGORITHM)
                                      for name in ("latent", "text"))
        samples += shard.samples
    return samples


def test_bucketed_outputs_are_the_models_on_the_stored_pixels_and_captions(ray_cluster, tars, tmp_path):
    pattern = make_tars(tars, [7, 5])
    config = write_config(tmp_path / "c.yaml", {"latent": LATENT, "text": {"fn": f"{TOY}:make_text", "input": "text",
                                                                           "batch_size": 4}})
    out = str(tmp_path / "out")
    result = run(pattern, "--output", out, "--config", config, *BUCKET_FLAGS)
    assert result.exit_code == 0, result.output
    assert check_outputs(out) == 12
    root = root_of(out)
    assert root["format_version"] == 6
    assert root["config"]["models"] == {"latent": {"fn": f"{TOY}:make_latent", "input": "image", "dtype": None},
                                        "text": {"fn": f"{TOY}:make_text", "input": "text", "dtype": None}}
    latent, text = root["outputs"]
    reached = {shard.bucket for shard in load_manifest(out).shards}
    assert latent == {
        "name": "latent", "input": "image", "dtype": "float16", "descr": "<f2",
        "shapes": [[4, h // 8, w // 8] if b in reached else None for b, (h, w) in enumerate(JOB_BUCKETS)],
        "identity": {"function": f"{TOY}:make_latent", "weights": weights_digest(LatentNet()), "version": None}}
    assert text["dtype"] == "float32" and text["descr"] == "<f4" and text["input"] == "text"
    assert text["shapes"] == [[8] if b in reached else None for b in range(len(JOB_BUCKETS))]
    assert text["identity"] == {"function": f"{TOY}:make_text", "weights": None, "version": "caption-hash-1"}
    assert_clean(out)


def test_the_reader_yields_each_batch_with_the_model_applied_to_its_pixels(ray_cluster, tars, tmp_path):
    """The contract end to end: a job with models, then ShardDataset: every batch's ``latent`` is the model on
    that batch's ``image`` (one bucket a batch), its ``text`` the text model on its captions, across epochs."""
    import torch

    from shardio import ShardDataset
    from tests.preprocess.models.toy_models import LatentNet

    pattern = make_tars(tars, [9, 6])
    config = write_config(tmp_path / "c.yaml", {"latent": LATENT, "text": {"fn": f"{TOY}:make_text", "input": "text",
                                                                           "batch_size": 4}})
    out = str(tmp_path / "out")
    assert run(pattern, "--output", out, "--config", config, *BUCKET_FLAGS).exit_code == 0
    ds = ShardDataset(out, batch_size=4, shuffle=True, seed=2)
    assert [o.name for o in ds.outputs] == ["latent", "text"]
    net, seen = LatentNet().eval(), 0
    for epoch in range(2):
        ds.set_epoch(epoch)
        for batch in ds:
            with torch.inference_mode():
                want = net(batch["image"])
            # Within float16's rounding: the job ran the model on other batches (convolution sums may round
            # differently in another batch composition), never on other pixels.
            assert batch["latent"].dtype == torch.float16
            torch.testing.assert_close(batch["latent"], want, rtol=1e-3, atol=1e-3)
            assert torch.equal(batch["text"], caption_hash(batch["txt"]))
            seen += len(batch["__key__"])
    assert seen == 2 * 15


def test_a_single_shape_jpeg_dataset_gives_the_model_the_decoded_pixels(ray_cluster, tars, tmp_path):
    pattern = make_tars(tars, [6])
    config = write_config(tmp_path / "c.yaml", {"latent": LATENT, "text": {"fn": f"{TOY}:make_text", "input": "text"}})
    out = str(tmp_path / "out")
    result = run(pattern, "--output", out, "--config", config, "--size", "16", "--samples-per-shard", "4",
                 "--encoding", "jpeg", "--quality", "50")
    assert result.exit_code == 0, result.output
    assert check_outputs(out, "jpeg") == 6
    assert root_of(out)["outputs"][0]["shapes"] == [[4, 2, 2]]


def test_a_rerun_runs_the_models_on_the_new_input_only(ray_cluster, tars, tmp_path):
    log = tmp_path / "captions.log"
    caption = lambda index: f"LOG={log}|caption {index}"  # noqa: E731
    pattern = make_tars(tars, [5, 4], caption)
    config = write_config(tmp_path / "c.yaml", {"latent": LATENT, "text": {"fn": f"{JOB}:make_logged_text",
                                                                           "input": "text"}})
    out = str(tmp_path / "out")
    flags = ["--size", "16", "--samples-per-shard", "4"]
    assert run(pattern, "--output", out, "--config", config, *flags).exit_code == 0
    assert sorted(log.read_text().splitlines()) == sorted(caption(i) for i in range(9))
    before = {name: os.stat(os.path.join(out, "shards", name)).st_mtime_ns
              for name in os.listdir(os.path.join(out, "shards"))}
    log.unlink()
    make_tars(tars, [3], caption, first=9, names=["02.tar"])
    result = run(pattern, "--output", out, *flags)  # the dataset's own config: its models
    assert result.exit_code == 0, result.output
    assert sorted(log.read_text().splitlines()) == sorted(caption(i) for i in range(9, 12)), "old inputs rerun"
    for name, mtime in before.items():
        assert os.stat(os.path.join(out, "shards", name)).st_mtime_ns == mtime, f"{name} was rewritten"
    for shard, _, captions in shard_rows(out):
        text = np.load(os.path.join(out, output_path(shard.path, "text")))
        np.testing.assert_array_equal(text, caption_hash(captions).numpy())
    assert sum(s.samples for s in load_manifest(out).shards) == 12
    assert_clean(out)


@pytest.mark.parametrize("new_input", [True, False], ids=["with-a-new-input", "nothing-new"])
def test_a_changed_model_is_refused_before_anything_is_touched(new_input, ray_cluster, tars, tmp_path, monkeypatch):
    pattern = make_tars(tars, [4])
    config = write_config(tmp_path / "c.yaml", {"latent": {"fn": f"{JOB}:make_other_latent", "device": "cpu"}})
    out = str(tmp_path / "out")
    flags = ["--size", "16", "--samples-per-shard", "4"]
    assert run(pattern, "--output", out, "--config", config, *flags).exit_code == 0
    recorded = root_of(out)["outputs"][0]["identity"]
    if new_input:
        make_tars(tars, [3], first=4, names=["01.tar"])
    state = dataset_state(out)
    listing = sorted(os.listdir(out))
    # Same function, other weights (in this process: the driver identifies the model before any task runs).
    monkeypatch.setitem(job_models.OTHER_WEIGHTS, "on", True)
    from preprocess.models import loading
    monkeypatch.setattr(loading, "_LOADED", {})
    result = run(pattern, "--output", out, *flags)
    assert result.exit_code == 2, result.output
    assert "latent" in result.output and recorded["weights"] in result.output
    other = weights_digest(job_models.make_other_latent())
    assert other != recorded["weights"] and other in result.output
    assert dataset_state(out) == state and sorted(os.listdir(out)) == listing, "a refused run touched the dataset"


def test_an_input_processed_with_another_model_than_the_drivers_is_not_committed(ray_cluster, tars, tmp_path,
                                                                                  monkeypatch):
    pattern = make_tars(tars, [3, 2])
    config = write_config(tmp_path / "c.yaml", {"latent": {"fn": f"{JOB}:make_other_latent", "device": "cpu"}})
    # The driver (this process) identifies other weights than the workers' (Ray's processes) load.
    monkeypatch.setitem(job_models.OTHER_WEIGHTS, "on", True)
    from preprocess.models import loading
    monkeypatch.setattr(loading, "_LOADED", {})
    out, report = str(tmp_path / "out"), str(tmp_path / "report.json")
    result = run(pattern, "--output", out, "--config", config, "--size", "16", "--report", report)
    assert result.exit_code == 1, result.output
    failed = json.load(open(report))["inputs_failed"]
    assert len(failed) == 2 and all("another model for output 'latent'" in f["reason"] for f in failed)
    assert load_manifest(out).shards == [] and "outputs" not in root_of(out)
    assert_clean(out)


@pytest.mark.parametrize("replicas", [0, 2], ids=["in-the-tasks", "in-two-replicas"])
def test_a_model_raising_on_a_batch_fails_that_input_only(replicas, ray_cluster, tars, tmp_path):
    """With two replicas each input is batched alone (input i feeds replica i mod 2), so the batch that raises
    holds the second input's samples only, as in the tasks."""
    pattern = make_tars(tars, [4, 3], caption=lambda index: "explode" if index == 5 else f"caption {index}")
    config = write_config(tmp_path / "c.yaml", {"latent": {**LATENT, "replicas": replicas},
                                                "text": {"fn": f"{JOB}:make_fragile_text", "input": "text",
                                                         "replicas": replicas}})
    out, report = str(tmp_path / "out"), str(tmp_path / "report.json")
    result = run(pattern, "--output", out, "--config", config, "--size", "16", "--samples-per-shard", "2",
                 "--report", report)
    assert result.exit_code == 1, result.output
    doc = json.load(open(report))
    assert [os.path.basename(p) for p in doc["inputs_processed"]] == ["00.tar"]
    (failed,) = doc["inputs_failed"]
    assert failed["input"].endswith("01.tar") and "text" in failed["reason"] and "exploded" in failed["reason"]
    assert "fingerprint" not in failed  # not the bytes' own failure: a rerun tries it again
    shards = load_manifest(out).shards
    assert {os.path.basename(s.input) for s in shards} == {"00.tar"}
    names = os.listdir(os.path.join(out, "shards"))
    assert not [n for n in names if n.startswith("01-")], f"the failed input left files: {names}"
    assert check_outputs(out) == 4


def test_kill_9_then_rerun_gives_the_uninterrupted_outputs(ray_cluster, tars, tmp_path) -> None:
    from tests.preprocess.test_crash_safety import kill_while_writing_then_rerun, start_run, watch

    pattern = make_tars(tars, [30, 21, 9])
    config = write_config(tmp_path / "c.yaml", {"latent": LATENT, "text": {"fn": f"{TOY}:make_text", "input": "text"}})
    bucketed = ("--mode", "bucket", "--bucket-step", "8")  # start_run adds --size 32 --samples-per-shard 8
    flags = ("--config", config, *bucketed)
    log, reference = str(tmp_path / "runs.log"), str(tmp_path / "reference")
    run_ = start_run(pattern, reference, ray_cluster, log, flags)
    startup_s, whole_s = watch(run_, reference)
    assert run_.returncode == 0, open(log).read()
    assert check_outputs(reference) == 60
    outs = kill_while_writing_then_rerun(
        lambda out: start_run(pattern, out, ray_cluster, log, flags),
        lambda out: run(pattern, "--output", out, *flags, "--size", "32", "--samples-per-shard", "8"),
        reference, tmp_path, seed=43, write_s=whole_s - startup_s)
    for out in outs:
        assert root_of(out)["outputs"] == root_of(reference)["outputs"]


def test_an_unversioned_model_is_said_and_recorded_by_its_function_alone(ray_cluster, tars, tmp_path):
    pattern = make_tars(tars, [3])
    config = write_config(tmp_path / "c.yaml", {"plain": {"fn": f"{TOY}:make_plain", "device": "cpu"}})
    out, report = str(tmp_path / "out"), str(tmp_path / "report.json")
    result = run(pattern, "--output", out, "--config", config, "--size", "16", "--report", report)
    assert result.exit_code == 0, result.output
    assert any("plain" in w and "no weights digest nor version" in w for w in json.load(open(report))["warnings"])
    (plain,) = root_of(out)["outputs"]
    assert plain["identity"] == {"function": f"{TOY}:make_plain", "weights": None, "version": None}
    assert plain["dtype"] == "float32" and plain["shapes"] == [[2]]


def test_outputs_in_a_bucket_are_the_bytes_of_a_local_run(ray_cluster, writable_cloud_bucket, tars, tmp_path):
    pattern = make_tars(tars, [5, 4])
    config = write_config(tmp_path / "c.yaml", {"latent": LATENT, "text": {"fn": f"{TOY}:make_text", "input": "text"}})
    flags = ["--config", config, "--size", "16", "--samples-per-shard", "4", "--ray-address", ray_cluster]
    local = str(tmp_path / "local")
    assert run(pattern, "--output", local, *flags).exit_code == 0
    result = run(pattern, "--output", writable_cloud_bucket.url("ds"), *flags)
    assert result.exit_code == 0, result.output
    copy = writable_cloud_bucket.fetch("ds", str(tmp_path / "copy"))
    assert_same_dataset(copy, local)
    assert root_of(copy)["outputs"] == root_of(local)["outputs"]
    assert check_outputs(copy) == 9


def test_repair_rebuilds_a_damaged_shards_outputs_byte_for_byte(ray_cluster, tars, tmp_path):
    pattern = make_tars(tars, [5, 3])
    config = write_config(tmp_path / "c.yaml", {"latent": LATENT, "text": {"fn": f"{TOY}:make_text", "input": "text"}})
    out = str(tmp_path / "out")
    assert run(pattern, "--output", out, "--config", config, "--size", "16", "--samples-per-shard", "2").exit_code == 0
    before = dataset_state(out)
    os.truncate(os.path.join(out, before["shards"][1]["path"]), 200)
    repaired = runner.invoke(app, ["verify", out, "--repair"], catch_exceptions=False)
    assert repaired.exit_code == 0, repaired.output
    after = dataset_state(out)
    assert after["files"] == before["files"] and after["output_files"] == before["output_files"]
    assert after["outputs"] == before["outputs"]
    assert_clean(out)


def test_encoding_none_keeps_the_outputs_of_the_pixels_it_does_not_keep(ray_cluster, tars, tmp_path):
    """``encoding: none``: each shard's pixel file is its 128-byte header alone, and the outputs are those a
    raw run of the same tars stores (the models were given the same pixels); verify finds nothing wrong."""
    import torch

    from shardio import ShardDataset

    pattern = make_tars(tars, [7, 5])
    config = write_config(tmp_path / "c.yaml", {"latent": LATENT})
    raw, none = str(tmp_path / "raw"), str(tmp_path / "none")
    assert run(pattern, "--output", raw, "--config", config, *BUCKET_FLAGS).exit_code == 0
    result = run(pattern, "--output", none, "--config", config, *BUCKET_FLAGS, "--encoding", "none")
    assert result.exit_code == 0, result.output
    assert root_of(none)["config"]["encoding"] == "none" and root_of(none)["format_version"] == 6
    shards = load_manifest(none).shards
    assert shards and all(os.path.getsize(os.path.join(none, s.path)) == 128 for s in shards)

    def latents(out: str) -> dict[str, bytes]:
        return {key: bytes(row.view(torch.int16).numpy().tobytes()) for batch in ShardDataset(out, batch_size=5)
                for key, row in zip(batch["__key__"], batch["latent"])}

    assert latents(none) == latents(raw)
    assert all("image" not in batch for batch in ShardDataset(none, batch_size=5))
    verified = runner.invoke(app, ["verify", none], catch_exceptions=False)
    assert verified.exit_code == 0, verified.output
    assert_clean(none)


def test_encoding_none_without_models_is_refused_before_anything_is_touched(tars, tmp_path):
    pattern = make_tars(tars, [2])
    result = runner.invoke(app, ["run", pattern, "--output", str(tmp_path / "out"), "--encoding", "none"])
    assert result.exit_code == 2 and "encoding: none keeps no pixels" in result.output
    assert not os.path.exists(tmp_path / "out")


def test_a_model_breaking_its_contract_stops_the_run_and_no_input_is_remembered_as_failed(ray_cluster, tars,
                                                                                          tmp_path):
    """The same model would break it on every input: the run stops (exit 2) naming the output, commits nothing,
    and records no input as failed, so the run with a mended model takes every input without --retry-failed."""
    pattern = make_tars(tars, [3, 2])
    broken = write_config(tmp_path / "broken.yaml", {"text": {"fn": f"{JOB}:make_one_short_text", "input": "text"}})
    out, report = str(tmp_path / "out"), str(tmp_path / "report.json")
    flags = ["--size", "16", "--samples-per-shard", "2"]
    result = run(pattern, "--output", out, "--config", broken, *flags, "--report", report)
    assert result.exit_code == 2, result.output
    words = " ".join(result.output.split())
    assert "models: text" in words and "returned" in words, words
    assert not os.path.exists(os.path.join(out, "manifest.json")) or load_manifest(out).shards == []
    mended = write_config(tmp_path / "mended.yaml", {"text": {"fn": f"{TOY}:make_text", "input": "text"}})
    result = run(pattern, "--output", out, "--config", mended, *flags, "--report", report)
    assert result.exit_code == 0, result.output
    doc = json.load(open(report))
    assert sorted(os.path.basename(p) for p in doc["inputs_processed"]) == ["00.tar", "01.tar"]
    assert sum(s.samples for s in load_manifest(out).shards) == 5
