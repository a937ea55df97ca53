"""The storage interface the dataset-directory protocol is written against (``shardio.store.storage``): the
local backend provides every method, and conditional create refuses an existing name."""

from __future__ import annotations

import os

import pytest

from shardio import errors

from shardio.store import storage


def test_both_backends_provide_the_interface_and_other_schemes_are_refused():
    from shardio.store.s3 import S3Storage

    required = {name for name in storage.Storage.__dict__ if not name.startswith("_")}
    assert required
    for backend in (storage.for_path("/tmp"), S3Storage()):
        missing = [name for name in required if not callable(getattr(backend, name, None))]
        assert not missing, f"{type(backend).__name__} lacks {missing}"
    assert storage.for_path("/tmp").is_local and not S3Storage.is_local
    with pytest.raises(errors.UnsupportedPath, match="gs://"):
        storage.for_path("gs://bucket/ds")
    with pytest.raises(errors.UnsupportedPath, match="needs a local path"):
        storage.check_local("s3://bucket/ds")


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


@pytest.mark.parametrize("url,store", [("gs://bucket/ds", "Google Cloud Storage"),
                                       ("az://container/ds", "Azure Blob Storage"),
                                       ("abfs://container/ds", "Azure Blob Storage")])
def test_gcs_and_azure_urls_say_they_are_not_supported_yet_and_why(url, store):
    with pytest.raises(errors.UnsupportedPath) as caught:
        storage.normalize(url)
    message = str(caught.value)
    assert message.startswith(f"{url}: {store} URLs are not supported yet")
    assert "conditional writes" in message and "copy the data to an s3:// bucket" in message
    assert errors.exit_code(caught.value) == 2
