"""``models:`` without Ray: the config stores them only when there are any (every other dataset keeps its config
bytes), the worker runs each model over the samples as the reader yields them (raw, JPEG and yuv420 pixels, the
captions) and writes one output file per shard through ``OutputFileWriter``, and a failed input leaves none."""

from __future__ import annotations

import os

import numpy as np
import pytest

from preprocess.config import JobConfig, load_config
from preprocess.job import fold_result
from preprocess.worker import InputResult, process_input
from shardio.errors import ConfigError
from shardio.format import dataset_format_version
from shardio.format.model_outputs import output_path, parse_output_header
from shardio.format.run_report import RunReport
from shardio.format.yuv_shard import yuv420_to_rgb
from shardio.read.jpeg_pixels import map_jpeg_shard
from shardio.store.checksum import WRITE_ALGORITHM, file_checksum
from shardio.write.commit import Committer
from shardio.write.shard_writer import InputShardWriter, OutputFileWriter
from preprocess.models.identity import weights_digest
from tests.preprocess.models.toy_models import LatentNet, caption_hash, latent_of
from tests.tar_factory import Member, TarFactory, index_image, jpeg_bytes

TOY = "tests.preprocess.models.toy_models"
MODELS = {"latent": {"fn": f"{TOY}:make_latent", "batch_size": 2, "device": "cpu"},
          "text": {"fn": f"{TOY}:make_text", "input": "text", "batch_size": 3, "device": "cpu"}}


def test_a_config_without_models_stores_none_and_keeps_its_bytes() -> None:
    plain = JobConfig()
    assert "models" not in plain.to_dict() and "models" not in plain.output_dict()
    assert JobConfig(models={}).to_dict() == plain.to_dict() and JobConfig(models={}).model_specs == ()
    assert dataset_format_version(plain.output_dict()) != 6


def test_models_are_stored_by_what_decides_the_outputs_and_read_back_by_a_rerun(tmp_path) -> None:
    cfg = JobConfig(models={"latent": f"{TOY}:make_latent", **{k: v for k, v in MODELS.items() if k == "text"}})
    assert [s.name for s in cfg.model_specs] == ["latent", "text"]
    assert cfg.to_dict()["models"]["text"] == {"fn": f"{TOY}:make_text", "input": "text", "batch_size": 3,
                                               "dtype": None, "device": "cpu", "replicas": "auto"}
    stored = cfg.output_dict()
    assert stored["models"] == {"latent": {"fn": f"{TOY}:make_latent", "input": "image", "dtype": None},
                                "text": {"fn": f"{TOY}:make_text", "input": "text", "dtype": None}}
    assert dataset_format_version(stored) == 6
    again = load_config(base=stored)
    assert again.output_dict() == stored  # batch_size, device, replicas: how a model runs; a rerun may change them
    config = tmp_path / "c.yaml"
    config.write_text(f"models:\n  latent: {{fn: '{TOY}:make_latent', batch_size: 64}}\n"
                      f"  text: {{fn: '{TOY}:make_text', input: text}}\n")
    assert load_config(str(config), base=stored).output_dict() == stored


def test_a_malformed_models_mapping_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="output name 'image'"):
        JobConfig(models={"image": f"{TOY}:make_latent"})  # a name a batch already carries


def _tar(directory: str, count: int, caption=lambda i: f"caption {i}") -> tuple[str, tuple[int, int]]:
    members = []
    for i in range(count):
        members += [Member(f"{i:04d}.jpg", jpeg_bytes(index_image(i, 40 + 8 * i, 48))),
                    Member(f"{i:04d}.txt", caption(i).encode())]
    TarFactory(directory).write("a.tar", members)
    path = os.path.join(directory, "a.tar")
    return path, (os.stat(path).st_size, os.stat(path).st_mtime_ns)


def _reader_pixels(out: str, shard, encoding: str, height: int, width: int) -> np.ndarray:
    path = os.path.join(out, shard["path"])
    if encoding == "jpeg":
        return map_jpeg_shard(shard["path"], path, shard["samples"], height, width).decode()
    stored = np.load(path)
    return stored if encoding == "raw" else yuv420_to_rgb(stored, height, width)


@pytest.mark.parametrize("encoding", ["raw", "jpeg", "yuv420"])
def test_each_shards_outputs_are_the_models_on_what_the_reader_yields(tmp_path, encoding) -> None:
    path, fingerprint = _tar(str(tmp_path), 7)
    cfg = JobConfig(height=16, width=24, samples_per_shard=3, encoding=encoding, quality=40, models=MODELS)
    out = str(tmp_path / "out")
    result = process_input(path, out, cfg, fingerprint)
    assert result.error is None and result.samples == 7 and len(result.shards) == 3
    identities = [output.pop("identity") for output in result.outputs]
    assert result.outputs == [{"name": "latent", "input": "image", "dtype": "float16", "shapes": [[0, [4, 2, 3]]]},
                              {"name": "text", "input": "text", "dtype": "float32", "shapes": [[0, [8]]]}]
    assert identities == [{"function": f"{TOY}:make_latent", "weights": weights_digest(LatentNet()), "version": None},
                          {"function": f"{TOY}:make_text", "weights": None, "version": "caption-hash-1"}]
    row = 0
    for shard in result.shards:
        pixels = _reader_pixels(out, shard, encoding, 16, 24)
        latent = np.load(os.path.join(out, output_path(shard["path"], "latent")))
        text = np.load(os.path.join(out, output_path(shard["path"], "text")))
        for got, sample in zip(latent, pixels):
            np.testing.assert_array_equal(got, latent_of(sample))
        np.testing.assert_array_equal(text, caption_hash([f"caption {i}" for i in range(row, row + len(text))]))
        assert tuple(shard["outputs"]) == tuple(file_checksum(os.path.join(out, output_path(shard["path"], n)),
                                                              WRITE_ALGORITHM) for n in ("latent", "text"))
        row += shard["samples"]


def test_a_model_raising_fails_the_input_and_leaves_no_file(tmp_path) -> None:
    path, fingerprint = _tar(str(tmp_path), 5, caption=lambda i: "explode" if i == 4 else f"caption {i}")
    models = {**MODELS, "text": {"fn": "tests.preprocess.models.job_models:make_fragile_text", "input": "text"}}
    out = str(tmp_path / "out")
    result = process_input(path, out, JobConfig(height=16, width=16, samples_per_shard=2, models=models), fingerprint)
    assert result.error is not None and "exploded" in result.error and "'text'" in result.error
    assert not result.lasting and result.shards == []
    assert os.listdir(os.path.join(out, "shards")) == []
    # A batch failing mid-input stops the input there: its later samples are not decoded.
    path, fingerprint = _tar(str(tmp_path / "early"), 6, caption=lambda i: "explode" if i == 1 else f"caption {i}")
    models = {**MODELS, "text": {**models["text"], "batch_size": 2}}
    result = process_input(path, out, JobConfig(height=16, width=16, models=models), fingerprint)
    assert "exploded" in result.error and result.samples_lost == 2
    assert os.listdir(os.path.join(out, "shards")) == []


def test_an_output_file_is_its_header_then_its_values_and_goes_with_an_aborted_input(tmp_path) -> None:
    writer = InputShardWriter(str(tmp_path), "in", 2, 2, 2)
    for i in range(3):
        writer.add(np.full((2, 2, 3), i, np.uint8), {"key": str(i)}, "in.tar")
    entries = writer.close("in.tar")
    values = {e.path: [("z", np.arange(e.samples * 6, dtype="<i8").reshape(e.samples, 2, 3)),
                       ("b", np.zeros((e.samples, 1), np.uint16))] for e in entries}
    with_outputs = writer.add_outputs(values)
    for entry in with_outputs:
        file = os.path.join(tmp_path, output_path(entry.path, "z"))
        with open(file, "rb") as f:
            assert parse_output_header(f.read(128), file) == ("<i8", (entry.samples, 2, 3))
        np.testing.assert_array_equal(np.load(file), values[entry.path][0][1])
        assert entry.outputs == (file_checksum(file, WRITE_ALGORITHM),
                                 file_checksum(os.path.join(tmp_path, output_path(entry.path, "b")), WRITE_ALGORITHM))
    assert len(os.listdir(tmp_path / "shards")) == 2 * 4
    writer.abort()
    assert os.listdir(tmp_path / "shards") == []
    with pytest.raises(ValueError, match="output dtype"):
        OutputFileWriter(str(tmp_path), "shards/x-00000.npy", "z").write(np.zeros((2, 3), np.float16), "<f4")
    assert os.listdir(tmp_path / "shards") == []


def _folded(tmp_path, *outputs: list) -> Committer:
    """A new dataset's committer after folding one empty result per ``outputs`` (InputResult.outputs)."""
    cfg = JobConfig(height=16, width=16, mode="bucket", bucket_step=8, models=MODELS)
    committer = Committer(str(tmp_path / "d"), None, interval_s=1e9, shape=(16, 16, 3), config=cfg.output_dict())
    report = RunReport("run", str(tmp_path / "d"), "", cfg.to_dict(), versions={"format_version": 6})
    identities = {"latent": {"function": "f", "weights": "w", "version": None},
                  "text": {"function": "t", "weights": None, "version": "1"}}
    for number, result_outputs in enumerate(outputs):
        fold_result(report, committer, InputResult(f"/in/{number}.tar", 1, 1, outputs=result_outputs), identities)
    return committer


def _outputs(latent_shapes, latent_dtype="float16", text_shapes=((0, [8]),)) -> list:
    return [{"name": "latent", "input": "image", "dtype": latent_dtype if latent_shapes else None,
             "shapes": [[b, s] for b, s in latent_shapes], "identity": {"function": "worker's"}},
            {"name": "text", "input": "text", "dtype": "float32" if latent_shapes else None,
             "identity": {"function": "worker's"},
             "shapes": [[b, s] for b, s in text_shapes] if latent_shapes else []}]


def test_the_roots_outputs_gather_each_buckets_first_shape_and_refuse_another(tmp_path) -> None:
    buckets = len(JobConfig(height=16, width=16, mode="bucket", bucket_step=8).buckets)
    assert _folded(tmp_path, _outputs([])).index.outputs == ()  # no sample yet: no dtype to record
    committer = _folded(tmp_path, _outputs([(0, [4, 1, 3])]), _outputs([(2, [4, 2, 2]), (0, [4, 1, 3])]))
    latent, text = committer.index.outputs
    assert latent.shapes == ((4, 1, 3), None, (4, 2, 2)) + (None,) * (buckets - 3)
    assert latent.identity == {"function": "f", "weights": "w", "version": None} and latent.dtype == "float16"
    assert text.shapes[0] == (8,) and text.input == "text"
    with pytest.raises(ConfigError, match=r"models: latent: /in/1.tar: .*bucket 0 holds samples of \[4, 1, 3\]"):
        _folded(tmp_path / "b", _outputs([(0, [4, 1, 3])]), _outputs([(0, [4, 1, 4])]))
    with pytest.raises(ConfigError, match="models: latent: the model returned float32 .* float16"):
        _folded(tmp_path / "c", _outputs([(0, [4, 1, 3])]), _outputs([(1, [4, 1, 3])], "float32"))


def test_a_bfloat16_output_is_stored_as_its_raw_bits(tmp_path) -> None:
    import torch

    path, fingerprint = _tar(str(tmp_path), 4)
    models = {"latent": {**MODELS["latent"], "dtype": "bfloat16"}}
    out = str(tmp_path / "out")
    result = process_input(path, out, JobConfig(height=16, width=16, samples_per_shard=4, models=models), fingerprint)
    assert result.error is None and result.outputs[0]["dtype"] == "bfloat16"
    (shard,) = result.shards
    file = os.path.join(out, output_path(shard["path"], "latent"))
    with open(file, "rb") as f:
        assert parse_output_header(f.read(128), file) == ("<u2", (4, 4, 2, 2))
    want = [torch.from_numpy(latent_of(p)).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
            for p in np.load(os.path.join(out, shard["path"]))]
    np.testing.assert_array_equal(np.load(file), np.stack(want))
