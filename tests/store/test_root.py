"""A place opened once (``shardio.store.root``): the backend chosen by ``open_root``, the path normalised so one
dataset is one key, a root pickled as its path and opened again where it lands."""

from __future__ import annotations

import pickle

import pytest

from shardio.errors import UnsupportedPath
from shardio.store import backends
from shardio.store.root import DatasetRoot, open_root, root_path


@pytest.mark.parametrize(("given", "held"), [
    ("s3://bucket/ds/", "s3://bucket/ds"), ("s3://bucket/ds", "s3://bucket/ds"),
    ("gs://bucket/a/b/", "gs://bucket/a/b"), ("file:///data/ds/", "/data/ds"), ("/data/ds/", "/data/ds"),
    ("ds/", "ds"), ("ds", "ds"), ("/", "/"),
])
def test_one_dataset_is_one_path(given, held):
    assert root_path(given) == held


def test_two_spellings_of_a_dataset_are_one_root(tmp_path):
    assert open_root(f"{tmp_path}/") == open_root(str(tmp_path)) == open_root(f"file://{tmp_path}")
    assert hash(open_root(f"{tmp_path}/")) == hash(open_root(str(tmp_path)))
    assert open_root(tmp_path) == open_root(str(tmp_path))  # a PathLike too
    assert open_root(str(tmp_path)) != open_root(str(tmp_path / "other"))


def test_a_root_is_opened_once(tmp_path, monkeypatch):
    chosen = []
    monkeypatch.setattr(backends, "scheme", lambda path: chosen.append(path) or "")
    root = open_root(str(tmp_path))
    assert open_root(root) is root and root.join("manifest.json") == str(tmp_path / "manifest.json")
    assert chosen == [str(tmp_path)] and root.is_local and root.storage is backends.for_path("/")


def test_a_root_travels_as_its_path(tmp_path):
    root = open_root(str(tmp_path))
    assert pickle.dumps(root).count(b"LocalStorage") == 0  # the backend is not pickled
    again = pickle.loads(pickle.dumps(root))
    assert again == root and again.storage is root.storage and repr(again) == f"DatasetRoot({str(tmp_path)!r})"
    with pytest.raises(AttributeError):
        root.path = "elsewhere"  # type: ignore[misc]


def test_an_unknown_scheme_is_refused_at_the_opening():
    with pytest.raises(UnsupportedPath, match="gcs://"):
        open_root("gcs://bucket/ds")
    assert not hasattr(DatasetRoot, "__fspath__")  # a root is never taken for a local file by accident
