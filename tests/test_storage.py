"""The storage interface the dataset-directory protocol is written against (``shardio.storage``): the
local backend provides every method, and conditional create refuses an existing name."""

from __future__ import annotations

import os

import pytest

from shardio import errors, storage


def test_local_storage_provides_the_interface():
    required = {name for name in storage.Storage.__dict__ if not name.startswith("_")}
    backend = storage.for_path("/tmp")
    assert required and all(callable(getattr(backend, name, None)) for name in required)
    with pytest.raises(errors.UnsupportedPath, match="s3://"):
        storage.for_path("s3://bucket/ds")


def test_conditional_create_refuses_an_existing_name(tmp_path):
    path = str(tmp_path / "0000000001.json")
    storage.publish_new(path, b"first")
    with pytest.raises(FileExistsError):
        storage.publish_new(path, b"second")
    assert open(path, "rb").read() == b"first"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0000000001.json"]  # no temp file left


def test_conditional_create_without_hard_links_still_refuses_an_existing_name(tmp_path, monkeypatch):
    def no_links(src, dst):
        raise PermissionError(1, "Operation not permitted")  # a filesystem without hard links

    monkeypatch.setattr(os, "link", no_links)
    path = str(tmp_path / "0000000001.json")
    storage.publish_new(path, b"first")
    with pytest.raises(FileExistsError):
        storage.publish_new(path, b"second")
    assert open(path, "rb").read() == b"first"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0000000001.json"]
