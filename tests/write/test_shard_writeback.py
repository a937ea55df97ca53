"""A shard being written is handed to the disk as it grows, so the commit's fsync has little left to wait for."""

from __future__ import annotations

import os

import numpy as np
import pytest

import shardio.write.shard_writer as writer_module
from shardio.store.checksum import file_checksum
from shardio.format import HEADER_BYTES
from shardio.write.shard_writer import InputShardWriter


def _images(count: int, height: int, width: int) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.integers(0, 256, (height, width, 3), dtype=np.uint8) for _ in range(count)]


def _write(out: str, images: list[np.ndarray]) -> list:
    writer = InputShardWriter(out, "input-0", images[0].shape[0], images[0].shape[1], len(images))
    for index, pixels in enumerate(images):
        writer.add(pixels, {"key": f"{index:04d}"}, "input.tar")
    return writer.close("input.tar")


def test_writeback_starts_every_few_megabytes_from_where_the_last_one_started(tmp_path, monkeypatch):
    calls: list[tuple[int, int, int, int]] = []

    def record(fd: int, offset: int, length: int, flags: int) -> int:
        calls.append((os.fstat(fd).st_size, offset, length, flags))
        return 0

    monkeypatch.setattr(writer_module, "_sync_file_range", record)
    monkeypatch.setattr(writer_module, "WRITEBACK_BYTES", 1 << 20)
    images = _images(20, 256, 256)  # 196,608 bytes each: 3.75 MiB in all
    [entry] = _write(str(tmp_path / "out"), images)

    # Every ~1 MiB of pixels, from where the previous request started, to the end of the file (length 0),
    # with everything written so far already in the file (flushed out of Python's buffer first).
    assert [(offset, length, flags) for _, offset, length, flags in calls] == [
        (0, 0, 2), (196_608 * 6, 0, 2), (196_608 * 12, 0, 2)]
    assert [size for size, *_ in calls] == [HEADER_BYTES + 196_608 * n for n in (6, 12, 18)]
    pixels = np.load(tmp_path / "out" / entry.path)
    assert np.array_equal(pixels, np.stack(images))
    assert file_checksum(str(tmp_path / "out" / entry.path), entry.checksum_algorithm) == entry.checksum


def test_a_failing_writeback_request_changes_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(writer_module, "_sync_file_range", lambda *args: -1)
    monkeypatch.setattr(writer_module, "WRITEBACK_BYTES", 1 << 20)
    images = _images(12, 256, 256)
    [entry] = _write(str(tmp_path / "out"), images)
    assert np.array_equal(np.load(tmp_path / "out" / entry.path), np.stack(images))


@pytest.mark.skipif(writer_module._sync_file_range is None, reason="sync_file_range is Linux-only")
def test_the_real_call_accepts_a_shard_file(tmp_path, monkeypatch):
    calls: list[int] = []
    real = writer_module._sync_file_range

    def checked(fd: int, offset: int, length: int, flags: int) -> int:
        calls.append(real(fd, offset, length, flags))
        return calls[-1]

    monkeypatch.setattr(writer_module, "_sync_file_range", checked)
    monkeypatch.setattr(writer_module, "WRITEBACK_BYTES", 1 << 20)
    images = _images(12, 256, 256)
    [entry] = _write(str(tmp_path / "out"), images)
    assert calls and all(result == 0 for result in calls)
    assert np.array_equal(np.load(tmp_path / "out" / entry.path), np.stack(images))


def test_a_shard_staged_for_an_upload_is_neither_written_back_nor_fsynced_but_a_local_one_is(
        tmp_path, s3_bucket, monkeypatch):
    """The upload is a bucket's durable step, so its scratch copy costs no disk writes; a local shard's staged
    file is the dataset's own, on disk before a commit lists it."""
    import io

    from shardio.store.root import open_root

    asked: list[str] = []
    fsync = os.fsync
    monkeypatch.setattr(writer_module, "_sync_file_range", lambda *args: asked.append("writeback") or 0)
    monkeypatch.setattr(os, "fsync", lambda fd: asked.append("fsync") or fsync(fd))
    monkeypatch.setattr(writer_module, "WRITEBACK_BYTES", 1 << 20)
    images = _images(12, 256, 256)

    url = f"s3://{s3_bucket}/out"
    [entry] = _write(url, images)
    assert asked == []
    uploaded = open_root(url).storage.read_bytes(f"{url}/{entry.path}")
    assert np.array_equal(np.load(io.BytesIO(uploaded)), np.stack(images))

    _write(str(tmp_path / "out"), images)
    assert "writeback" in asked and asked.count("fsync") == 2  # the pixels and the metadata
