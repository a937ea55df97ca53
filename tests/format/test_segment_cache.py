"""The node-local copy of a remote dataset's index segments (``shardio.format.segment_cache``), against the
session's S3 server: processes opening one dataset at once fetch each segment once in all; a reopen after a
new commit fetches only the new segment; a corrupt or forged copy is never used but fetched again; a cache
on a read-only file system falls back to reading whole, and a directory or file in the cache's way is a
clear error."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest

from shardio.errors import ShardError
from shardio.format.manifests import load_index
from shardio.store.s3 import S3Storage
from tests.dataset_fixtures import make_dataset, retire_input
from tests.object_stores import CloudBucket
from tests.read_only_fs import make_read_only

# A process that opens the dataset and prints how many segment downloads it made.
_OPEN = """
import sys
from shardio.format.manifests import load_index
from shardio.store.s3 import S3Storage
fetched = []
real = S3Storage.download
def counted(self, path, local_path, algorithm, *args, **kwargs):
    fetched.append(path)
    return real(self, path, local_path, algorithm, *args, **kwargs)
S3Storage.download = counted
index = load_index(sys.argv[1], segment_cache=sys.argv[2])
print(len(fetched), len(index.shards))
"""


@pytest.fixture
def dataset(s3_server, s3_bucket, tmp_path) -> tuple[str, str, CloudBucket]:
    local = str(tmp_path / "local")
    make_dataset(local, inputs=(40, 45, 32), samples_per_shard=8)
    retire_input(local, "input-1.tar")  # a second commit: two segments
    bucket = CloudBucket(s3_server, s3_bucket)
    return local, bucket.upload_dir(local), bucket


@pytest.fixture
def fetched(monkeypatch) -> list[str]:
    urls: list[str] = []
    real = S3Storage.download

    def counted(self, path, local_path, algorithm, *args, **kwargs):
        urls.append(path)
        return real(self, path, local_path, algorithm, *args, **kwargs)

    monkeypatch.setattr(S3Storage, "download", counted)
    return urls


def segments(directory: str) -> list[str]:
    return sorted(name for name in os.listdir(directory) if name.endswith(".npz"))


def test_processes_opening_at_once_fetch_each_segment_once_in_all(dataset, tmp_path):
    local, url, _ = dataset
    cache = str(tmp_path / "cache")
    runs = [subprocess.Popen([sys.executable, "-c", _OPEN, url, cache], stdout=subprocess.PIPE, text=True)
            for _ in range(4)]
    answers = [run.communicate(timeout=120)[0].split() for run in runs]
    assert all(run.returncode == 0 for run in runs)
    assert sum(int(fetches) for fetches, _ in answers) == 2  # two segments, each fetched by one process
    assert {shards for _, shards in answers} == {str(len(load_index(local).shards))}
    assert segments(os.path.join(cache, "index")) == segments(os.path.join(local, "index"))
    assert not [n for n in os.listdir(os.path.join(cache, "index")) if n.startswith(".tmp-")]


def test_a_reopen_after_a_commit_fetches_only_the_new_segment(dataset, tmp_path, fetched):
    local, url, bucket = dataset
    cache = str(tmp_path / "cache")
    load_index(url, segment_cache=cache)
    assert len(fetched) == 2
    load_index(url, segment_cache=cache)
    assert len(fetched) == 2  # a reopen: nothing fetched
    before = set(segments(os.path.join(local, "index")))
    retire_input(local, "input-2.tar")
    bucket.upload_dir(local)
    index = load_index(url, segment_cache=cache)
    [new] = set(segments(os.path.join(local, "index"))) - before
    assert fetched[2:] == [f"{url}/index/{new}"]
    assert len(index.shards) == len(load_index(local).shards)


@pytest.mark.parametrize("damage", ["corrupt", "forged"])
def test_a_corrupt_or_forged_copy_is_never_used_but_fetched_again(dataset, tmp_path, fetched, damage):
    local, url, _ = dataset
    cache = str(tmp_path / "cache")
    expected = len(load_index(url, segment_cache=cache).shards)
    first, second = segments(os.path.join(cache, "index"))
    victim = os.path.join(cache, "index", first)
    if damage == "corrupt":
        with open(victim, "r+b") as f:
            f.seek(100)
            byte = f.read(1)
            f.seek(100)
            f.write(bytes([byte[0] ^ 0xFF]))
    else:  # another segment's bytes under this one's name
        with open(os.path.join(cache, "index", second), "rb") as f:
            forged = f.read()
        with open(victim, "wb") as f:
            f.write(forged)
    fetched.clear()
    assert len(load_index(url, segment_cache=cache).shards) == expected
    assert fetched == [f"{url}/index/{first}"]
    with open(victim, "rb") as f, open(os.path.join(local, "index", first), "rb") as g:
        assert f.read() == g.read()


def test_without_a_segment_cache_every_open_reads_the_segments_again(dataset, fetched):
    _, url, _ = dataset
    load_index(url)
    load_index(url)
    assert fetched == []  # read whole (read_bytes), never kept


@pytest.mark.parametrize("warm", [False, True])
def test_a_cache_on_a_read_only_file_system_reads_segments_whole_with_one_warning(dataset, tmp_path, fetched,
                                                                                 monkeypatch, warm):
    """A cache directory on a read-only mount (EROFS): an empty one falls back to reading each segment
    whole from the store, with one warning however many opens; a warm one is used as it is, silently."""
    local, url, _ = dataset
    cache = str(tmp_path / "cache")
    if warm:
        load_index(url, segment_cache=cache)
    else:
        os.makedirs(cache)
    fetched.clear()
    make_read_only(monkeypatch, cache)
    expected = len(load_index(local).shards)
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        assert [len(load_index(url, segment_cache=cache).shards) for _ in range(2)] == [expected] * 2
    assert fetched == []  # nothing downloaded into the cache: read whole, or the warm copies
    messages = [str(w.message) for w in warned]
    if warm:
        assert messages == []
    else:
        assert len(messages) == 1 and messages[0].startswith(os.path.join(cache, "index")), messages
        assert "read-only file system" in messages[0].lower() and "whole" in messages[0], messages


def test_a_copy_replaced_by_a_directory_or_an_index_that_is_a_file_is_a_clear_error(dataset, tmp_path):
    """What stands in the cache's way is named, and left alone (the cache does not remove what is not
    its own file)."""
    _, url, _ = dataset
    cache = str(tmp_path / "cache")
    load_index(url, segment_cache=cache)
    first = os.path.join(cache, "index", segments(os.path.join(cache, "index"))[0])
    os.remove(first)
    os.makedirs(first)
    with pytest.raises(ShardError, match=f"{first}: a directory where the segment cache keeps a file"):
        load_index(url, segment_cache=cache)
    assert os.path.isdir(first)
    other = str(tmp_path / "other")
    os.makedirs(other)
    with open(os.path.join(other, "index"), "w") as f:
        f.write("not a folder")
    with pytest.raises(ShardError, match=f"{os.path.join(other, 'index')}: not a directory"):
        load_index(url, segment_cache=other)
    assert os.path.isfile(os.path.join(other, "index"))
