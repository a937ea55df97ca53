"""Model outputs in the format (version 6, spec "Model outputs"): the root's ``outputs``, an output file beside
its shard, each shard's output digests in the index (carried by compaction), the version rule, and an output
file listed, retired and kept by the cleaning with its shard."""

from __future__ import annotations

import json
import os
from dataclasses import replace

import numpy as np
import pytest

from shardio.errors import ShardFormatError
from shardio.format import InputEntry, Manifest, dataset_format_version
from shardio.format.manifests import load_index, load_manifest
from shardio.format.model_outputs import (OutputSpec, output_header, output_nbytes, output_path, parse_output_header,
                                          root_outputs)
from shardio.store.checksum import WRITE_ALGORITHM, file_checksum
from shardio.write.cleaning import clean_leftovers
from shardio.write.commit import Committer
from shardio.write.lock import writing
from shardio.write.shard_writer import InputShardWriter, write_manifest

H = W = 4
LATENT = (2, 2, 2)  # per sample, float16
EMBED = (3,)  # per sample, int32
MODELS = {"latent": {"fn": "toy:vae", "input": "image", "batch_size": 4, "dtype": "float16", "device": "cpu"},
          "embed": {"fn": "toy:text", "input": "text", "batch_size": 4, "dtype": "int32", "device": "cpu"}}


def _specs() -> tuple[OutputSpec, ...]:
    return (OutputSpec("latent", "image", "float16", (LATENT,), {"function": "toy:vae", "weights": "xxh3_128:ab",
                                                                  "version": None}),
            OutputSpec("embed", "text", "int32", (EMBED,), {"function": "toy:text", "weights": None, "version": "1"}))


def _latent(index: int) -> np.ndarray:
    return np.full(LATENT, index / 8, dtype="<f2")


def _embed(index: int) -> np.ndarray:
    return np.array([index, -index, 7], dtype="<i4")


def _write_output(directory: str, shard_path: str, name: str, rows: np.ndarray, descr: str) -> str:
    path = os.path.join(directory, output_path(shard_path, name))
    with open(path, "wb") as f:
        f.write(output_header(descr, len(rows), rows.shape[1:]))
        f.write(np.ascontiguousarray(rows).tobytes())
    return file_checksum(path, WRITE_ALGORITHM)


def _input(directory: str, number: int, count: int, first: int) -> tuple[InputEntry, list]:
    """Input ``number``'s shards (of 3 samples) with both outputs, as the job writes them."""
    name = f"input-{number}.tar"
    writer = InputShardWriter(directory, f"input-{number}", H, W, 3)
    for i in range(first, first + count):
        writer.add(np.full((H, W, 3), i, np.uint8), {"key": f"s{i}", "txt": f"caption {i}"}, name)
    entries, out, index = writer.close(name), [], first
    for entry in entries:
        rows = range(index, index + entry.samples)
        digests = (_write_output(directory, entry.path, "latent", np.stack([_latent(i) for i in rows]), "<f2"),
                   _write_output(directory, entry.path, "embed", np.stack([_embed(i) for i in rows]), "<i4"))
        out.append(replace(entry, outputs=digests))
        index += entry.samples
    return InputEntry(size=count, mtime_ns=0, samples=count, failed=0, shards=[e.path for e in out]), out


def _dataset(directory: str, inputs: tuple[int, ...] = (5, 4)) -> Manifest:
    os.makedirs(directory, exist_ok=True)
    manifest = Manifest(shape=(H, W, 3), config={"height": H, "width": W, "models": MODELS},
                        versions={"shardio": "test"}, outputs=_specs())
    first = 0
    for number, count in enumerate(inputs):
        entry, shards = _input(directory, number, count, first)
        manifest.inputs[f"input-{number}.tar"] = entry
        manifest.shards.extend(shards)
        first += count
    write_manifest(directory, manifest)
    return manifest


def _root(directory: str) -> dict:
    with open(os.path.join(directory, "manifest.json")) as f:
        return json.load(f)


class TestOutputFiles:
    @pytest.mark.parametrize("pixels, expected", [("shards/a-00001.npy", "shards/a-00001.latent.npy"),
                                                  ("shards/a-00001.jpg.npy", "shards/a-00001.latent.npy"),
                                                  ("shards/a.b-00001.yuv.npy", "shards/a.b-00001.latent.npy")])
    def test_an_output_file_is_named_after_its_shard(self, pixels: str, expected: str) -> None:
        assert output_path(pixels, "latent") == expected

    @pytest.mark.parametrize("descr, shape", [("<f2", (4, 32, 32)), ("<u2", (77, 768)), ("|b1", (1,)),
                                              ("<i8", (2, 3, 4, 5, 6, 7, 8))])
    def test_numpy_reads_an_output_file_and_its_size_is_exact(self, tmp_path, descr: str, shape: tuple) -> None:
        rows = np.arange(5 * int(np.prod(shape))).astype(descr).reshape(5, *shape)
        path = tmp_path / "x.npy"
        path.write_bytes(output_header(descr, 5, shape) + rows.tobytes())
        assert os.path.getsize(path) == output_nbytes(5, shape, descr)
        back = np.load(path, mmap_mode="r")
        assert back.dtype == np.dtype(descr) and back.shape == (5, *shape) and (back == rows).all()
        assert parse_output_header(path.read_bytes()[:128], "x.npy") == (descr, (5, *shape))

    def test_a_header_of_another_kind_is_refused_naming_the_file(self) -> None:
        with pytest.raises(ShardFormatError, match="x.npy"):
            parse_output_header(b"not a header" * 20, "x.npy")
        with pytest.raises(ShardFormatError, match="x.npy"):
            parse_output_header(output_header(">f4", 2, (3,)).replace(b">f4", b"<c8"), "x.npy")


class TestRoot:
    def test_a_dataset_with_outputs_is_version_6_and_keeps_them(self, tmp_path) -> None:
        written = _dataset(str(tmp_path / "ds"))
        root = _root(str(tmp_path / "ds"))
        assert root["format_version"] == 6 == dataset_format_version(root["config"])
        assert [o["name"] for o in root["outputs"]] == ["latent", "embed"]
        assert root["outputs"][0]["descr"] == "<f2" and root["outputs"][0]["shapes"] == [list(LATENT)]
        index = load_index(str(tmp_path / "ds"))
        assert index.outputs == _specs()
        assert [e.outputs for e in index.shards] == [e.outputs for e in written.shards]
        assert all(len(e.outputs) == 2 and all(len(d) == 32 for d in e.outputs) for e in index.shards)
        manifest = load_manifest(str(tmp_path / "ds"))
        assert manifest.outputs == _specs()
        assert [e.outputs for e in manifest.shards] == [e.outputs for e in written.shards]

    def test_a_dataset_without_models_keeps_its_version_and_root(self, tmp_path) -> None:
        directory = str(tmp_path / "plain")
        os.makedirs(directory)
        writer = InputShardWriter(directory, "in", H, W, 3)
        writer.add(np.zeros((H, W, 3), np.uint8), {"key": "k"}, "in.tar")
        manifest = Manifest(shape=(H, W, 3), config={"height": H, "width": W}, versions={})
        manifest.shards = writer.close("in.tar")
        write_manifest(directory, manifest)
        root = _root(directory)
        assert root["format_version"] == 3 and "outputs" not in root
        assert all(e.outputs == () for e in load_index(directory).shards)

    @pytest.mark.parametrize("edit, message", [
        (lambda r: r.update(format_version=5), "models"),
        (lambda r: r["config"].pop("models"), "models"),
        (lambda r: r["outputs"][0].update(descr="<f4"), "dtype"),
        (lambda r: r["outputs"][0].update(shapes=[[2], [2]]), "shapes"),
        (lambda r: r["outputs"][0].update(shapes=[[0, 2]]), "shapes"),
        (lambda r: r["outputs"][1].update(name="latent"), "twice"),
        (lambda r: r["outputs"][1].update(name="no-dash"), "identifier"),
        (lambda r: r["outputs"].pop(), "output digests"),
    ])
    def test_a_root_that_breaks_the_rules_is_refused_naming_it(self, tmp_path, edit, message: str) -> None:
        directory = str(tmp_path / "ds")
        _dataset(directory)
        root = _root(directory)
        edit(root)
        with open(os.path.join(directory, "manifest.json"), "w") as f:
            json.dump(root, f)
        for load in (load_index, load_manifest):
            with pytest.raises(ShardFormatError, match=message) as caught:
                load(directory)
            assert "manifest.json" in str(caught.value) or "index/" in str(caught.value)

    def test_root_outputs_of_a_root_without_them_is_empty(self) -> None:
        assert root_outputs({}, 1, "r") == ()


class TestIndex:
    def test_compaction_carries_every_shards_digests(self, tmp_path) -> None:
        directory = str(tmp_path / "ds")
        _dataset(directory, inputs=(2,))
        expected = {e.path: e.outputs for e in load_index(directory).shards}
        first = 2
        with writing(directory):
            committer = Committer(directory, load_index(directory))
            for number in range(1, 12):  # 11 more commits of one input each: segments merged on the way
                entry, shards = _input(directory, number, 2, first)
                first += 2
                committer.add_input(f"input-{number}.tar", entry.size, entry.mtime_ns, shards, entry.failed)
                committer.maybe_commit(force=True)
                expected.update({e.path: e.outputs for e in shards})
        root = _root(directory)
        assert len(root["segments"]) < 12, "no compaction happened: the test proves nothing"
        assert {e.path: e.outputs for e in load_index(directory).shards} == expected
        assert {e.path: e.outputs for e in load_manifest(directory).shards} == expected


class TestFilesOfAShard:
    def test_the_cleaning_keeps_listed_outputs_and_removes_a_killed_runs(self, tmp_path) -> None:
        directory = str(tmp_path / "ds")
        _dataset(directory)
        listed = sorted(os.listdir(os.path.join(directory, "shards")))
        assert any(name.endswith(".latent.npy") for name in listed)
        leftover = os.path.join(directory, "shards", "input-9-00000.latent.npy")
        with open(leftover, "wb") as f:
            f.write(b"x")
        cleaned = clean_leftovers(directory, load_index(directory))
        assert cleaned.removed == 1 and not os.path.exists(leftover)
        assert sorted(os.listdir(os.path.join(directory, "shards"))) == listed

    def test_a_replaced_input_retires_its_output_files(self, tmp_path) -> None:
        directory = str(tmp_path / "ds")
        old = _dataset(directory, inputs=(3,))
        _, shards = _input(directory, 0, 3, 0)
        moved = [replace(e, path=e.path.replace("input-0", "input-0b"),
                         meta_path=e.meta_path.replace("input-0", "input-0b")) for e in shards]
        for before, after in zip(shards, moved):
            for rel in (before.path, before.meta_path, output_path(before.path, "latent"),
                        output_path(before.path, "embed")):
                target = rel.replace("input-0", "input-0b")
                with open(os.path.join(directory, rel), "rb") as src, open(os.path.join(directory, target), "wb") as f:
                    f.write(src.read())
        with writing(directory):
            committer = Committer(directory, load_index(directory))
            committer.add_input("input-0.tar", 3, 1, moved, 0)
            committer.maybe_commit(force=True)
        retired = {r["path"] for r in _root(directory)["retired"]}
        old_shard = old.shards[0].path
        assert {old_shard, output_path(old_shard, "latent"), output_path(old_shard, "embed")} <= retired


def test_a_root_without_pixels_and_without_models_is_refused(tmp_path) -> None:
    directory = str(tmp_path / "ds")
    _dataset(directory)
    root = _root(directory)
    root.update(format_version=3)
    root["config"].pop("models")
    root["config"]["encoding"] = "none"
    with open(os.path.join(directory, "manifest.json"), "w") as f:
        json.dump(root, f)
    with pytest.raises(ShardFormatError, match="manifest.json: config encoding 'none' without models"):
        load_index(directory)


def test_a_shard_without_pixels_is_its_header_alone(tmp_path) -> None:
    from shardio.format import NONE, expected_shard_size, npy_header

    writer = InputShardWriter(str(tmp_path), "in", H, W, 3, NONE)
    for i in range(5):
        writer.add(np.full((H, W, 3), i, np.uint8), {"key": f"s{i}"}, "in.tar")
    entries = writer.close("in.tar")
    for entry in entries:
        data = (tmp_path / entry.path).read_bytes()
        assert data == npy_header(entry.samples, 0, 0) and entry.bytes == 128
        assert expected_shard_size(entry, (H, W, 3), NONE) == 128
        assert np.load(tmp_path / entry.path).shape == (entry.samples, 0, 0, 3)
