"""A cache directory shared by several users (``SHARDIO_CACHE_DIR`` on a team disk): another user reads
what is cached there without downloading it again, never removes a file it does not own, and a shard it
cannot write there is a clear error at once. Switching users needs root; the reader runs in a forked
child that becomes ``nobody``."""

from __future__ import annotations

import os
import shutil
import stat
import tempfile

import pytest

from shardio.errors import ShardError
from shardio.read.cache.shard_cache import ShardCache
from tests.dataset_fixtures import make_dataset
from tests.other_user import as_nobody, needs_root
from tests.read.test_shard_cache import FolderStore, read_all, units_of

pytestmark = needs_root


@pytest.fixture
def shared():
    """A folder every user can traverse (a pytest tmp_path is private to its user), with a dataset posing
    as the store, and a cache directory the first user (root, umask 022) warms."""
    root = tempfile.mkdtemp(prefix="shardio-shared-cache-", dir="/tmp")
    os.chmod(root, 0o755)
    old = os.umask(0o022)
    try:
        dataset = os.path.join(root, "ds")
        make_dataset(dataset, inputs=(20, 12), samples_per_shard=8)  # 5 shards
        units, shape = units_of(dataset)
        cache_dir = os.path.join(root, "cache")
        cache = ShardCache(units, FolderStore(dataset), cache_dir, 10**9, shape=shape)
        expected = read_all(cache, list(range(len(units))))
        cache.close()
    finally:
        os.umask(old)
    yield dataset, cache_dir, units, shape, expected
    shutil.rmtree(root, ignore_errors=True)


def _files(folder: str) -> dict[str, int]:
    return {name: os.stat(os.path.join(folder, name)).st_size for name in os.listdir(folder)
            if stat.S_ISREG(os.stat(os.path.join(folder, name)).st_mode)}


def test_another_user_reads_a_warm_shared_cache_and_removes_nothing(shared):
    dataset, cache_dir, units, shape, expected = shared
    before = _files(cache_dir)

    def read_everything() -> dict:
        store = FolderStore(dataset)
        cache = ShardCache(units, store, cache_dir, 10**9, shape=shape)
        try:
            got = read_all(cache, list(range(len(units))))
        finally:
            cache.close()
        return {"same": got == expected, "downloads": cache.stats["downloads"]}

    assert as_nobody(read_everything) == {"same": True, "downloads": 0}
    assert _files(cache_dir) == before  # the first user's files: not the other's to remove


def test_a_shard_another_user_cannot_write_is_a_clear_error_at_once(shared):
    dataset, cache_dir, units, shape, _ = shared
    for name in os.listdir(cache_dir):
        if name.startswith(units[2].key):
            os.remove(os.path.join(cache_dir, name))

    def read_the_missing_one() -> dict:
        store = FolderStore(dataset)
        cache = ShardCache(units, store, cache_dir, 10**9, shape=shape)
        try:
            read_all(cache, [2])
        except ShardError as exc:
            return {"error": str(exc), "attempts": sum(store.calls.values())}
        finally:
            cache.close()
        return {"error": None}

    answer = as_nobody(read_the_missing_one)
    assert answer["error"] is not None and cache_dir in answer["error"], answer
    assert "cache_dir" in answer["error"]  # what to do about it
    assert answer["attempts"] <= 1  # not retried: a permission does not come back by waiting
