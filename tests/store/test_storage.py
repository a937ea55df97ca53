"""The storage interface the dataset-directory protocol is written against (``shardio.store.base``): the
local backend provides every method, conditional create refuses an existing name, and the backend table
serves each scheme from one place."""

from __future__ import annotations

import os

import pytest

from shardio import errors

from shardio.store import backends, paths
from shardio.store.backends import for_path, register_backend
from shardio.store.base import Storage
from shardio.store.paths import check_local, normalize


def test_every_backend_provides_the_interface_and_other_schemes_are_refused():
    from shardio.store.azure import AzureStorage
    from shardio.store.gcs import GCSStorage
    from shardio.store.s3 import S3Storage

    required = {name for name in Storage.__dict__ if not name.startswith("_")}
    assert required
    for backend in (for_path("/tmp"), S3Storage(), GCSStorage(), AzureStorage()):
        missing = [name for name in required if not callable(getattr(backend, name, None))]
        assert not missing, f"{type(backend).__name__} lacks {missing}"
    assert for_path("/tmp").is_local and not any(b.is_local for b in (S3Storage, GCSStorage, AzureStorage))
    assert isinstance(for_path("gs://bucket/ds"), GCSStorage) and isinstance(for_path("az://c/ds"), AzureStorage)
    with pytest.raises(errors.UnsupportedPath, match="hdfs://"):
        for_path("hdfs://bucket/ds")
    with pytest.raises(errors.UnsupportedPath, match="needs a local path"):
        check_local("s3://bucket/ds")


def test_conditional_create_refuses_an_existing_name(tmp_path):
    path = str(tmp_path / "0000000001.json")
    for_path(path).publish_new(path, b"first")
    with pytest.raises(FileExistsError):
        for_path(path).publish_new(path, b"second")
    assert open(path, "rb").read() == b"first"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0000000001.json"]  # no temp file left


def test_conditional_create_without_hard_links_still_refuses_an_existing_name(tmp_path, monkeypatch):
    def no_links(src, dst):
        raise PermissionError(1, "Operation not permitted")  # a filesystem without hard links

    monkeypatch.setattr(os, "link", no_links)
    path = str(tmp_path / "0000000001.json")
    for_path(path).publish_new(path, b"first")
    with pytest.raises(FileExistsError):
        for_path(path).publish_new(path, b"second")
    assert open(path, "rb").read() == b"first"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0000000001.json"]


@pytest.mark.parametrize("url,taken", [("gcs://bucket/ds", "gs://BUCKET/PATH"),
                                       ("abfs://container/ds", "az://CONTAINER/PATH"),
                                       ("azure://container/ds", "az://CONTAINER/PATH")])
def test_other_spellings_of_gcs_and_azure_urls_name_the_one_taken(url, taken):
    with pytest.raises(errors.UnsupportedPath) as caught:
        normalize(url)
    message = str(caught.value)
    assert message.startswith(f"{url}: ") and f"write it as {taken}" in message
    assert errors.exit_code(caught.value) == 2
    assert normalize("gs://bucket/ds/") == "gs://bucket/ds" and normalize("az://c/ds/") == "az://c/ds"


def test_every_scheme_is_served_from_the_one_table_and_a_backend_is_made_once():
    assert set(backends._BACKENDS) == {"", *paths.REMOTE_SCHEMES}
    assert for_path("/tmp/a") is for_path("file:///tmp/b")  # one local backend per process

    class Recording:
        is_local = False

    made = []
    previous = register_backend("s3", lambda: made.append(Recording()) or made[-1])
    try:
        first = for_path("s3://bucket/a")
        assert for_path("s3://other/b") is first and made == [first]  # created once, then held
    finally:
        register_backend("s3", previous)
    with pytest.raises(ValueError, match="hdfs"):
        register_backend("hdfs", Recording)
