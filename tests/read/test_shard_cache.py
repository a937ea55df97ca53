"""The reader's shard cache (shardio/read/cache/shard_cache.py, shardio/read/cache/cache_dir.py) against a local folder
posing as the store: a small fake that counts downloads and samples the cache directory's size at every one.

What is checked: bytes identical to the local shards; each shard downloaded once when the limit allows;
the eviction is Belady's (a sequence where LRU would evict the other shard); the directory never holds
more than the limit; a download that fails or is killed half-way leaves no file that is used later; two
processes sharing a cache directory download each shard once in total; a corrupt or missing object is a
``ShardError`` naming its URL.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from shardio.read.cache import shard_cache
from shardio.read.cache.cache_dir import CachedShard
from shardio.read.cache.cache_setup import parse_size
from shardio.store.checksum import new_hasher
from shardio.errors import ShardError
from shardio.format import HEADER_BYTES
from shardio.format.manifests import load_manifest
from shardio.read.cache.shard_cache import ShardCache
from tests.dataset_fixtures import make_dataset, self_identifying_pixels, write_inputs
from tests.read_only_fs import make_read_only
from tests.paths import REPO_ROOT

BASE = "mem://bucket/ds"
REPO = REPO_ROOT


class FolderStore:
    """``Storage.download`` from a local folder: ``mem://bucket/ds/REL`` is ``root/REL``. Counts each URL's
    downloads and records the cache directory's size (every file, temp files included) after each."""

    def __init__(self, root: str, cache_dir: str | None = None, corrupt: tuple[str, ...] = (),
                 missing: tuple[str, ...] = (), fail_first: int = 0) -> None:
        self.root, self.cache_dir = root, cache_dir
        self.corrupt, self.missing, self.fail_first = corrupt, missing, fail_first
        self.calls: dict[str, int] = {}
        self.sizes: list[int] = []

    def download(self, path: str, local_path: str, algorithm: str) -> str:
        self.calls[path] = self.calls.get(path, 0) + 1
        source = os.path.join(self.root, path[len(BASE) + 1:])
        if any(path.endswith(m) for m in self.missing):
            raise FileNotFoundError(path)
        data = read_bytes(source)
        if any(path.endswith(c) for c in self.corrupt):
            data = data[:HEADER_BYTES] + bytes(len(data) - HEADER_BYTES)  # right size and header, wrong bytes
        with open(local_path, "wb") as f:
            if self.fail_first > 0:
                self.fail_first -= 1
                f.write(data[: len(data) // 2])
                f.flush()
                self.sample()
                raise ConnectionResetError("connection reset half-way")
            f.write(data)
        self.sample()
        digest = new_hasher(algorithm)
        digest.update(data)
        return digest.hexdigest()  # of the bytes written, as Storage.download

    def sample(self) -> None:
        if self.cache_dir is not None:
            self.sizes.append(dir_bytes(self.cache_dir))


def dir_bytes(folder: str) -> int:
    total = 0
    for name in os.listdir(folder):
        try:
            if os.path.isfile(os.path.join(folder, name)):
                total += os.path.getsize(os.path.join(folder, name))
        except FileNotFoundError:  # renamed or removed meanwhile by another download thread
            pass
    return total


def units_of(directory: str) -> tuple[list[CachedShard], tuple[int, int, int]]:
    manifest = load_manifest(directory)
    return [CachedShard.of(BASE, entry, _join) for entry in manifest.shards], manifest.shape


def _join(*parts: str) -> str:
    return "/".join(parts)


def read_bytes(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def local_pixels(directory: str, unit: CachedShard) -> np.ndarray:
    return np.load(os.path.join(directory, unit.npy_url[len(BASE) + 1:]))


def read_all(cache: ShardCache, sequence: list[int]) -> list[bytes]:
    """Read ``sequence`` as the dataset does: advance to each piece, map it, let the map go."""
    cache.plan([[s] for s in sequence])
    out = []
    for i, shard in enumerate(sequence):
        cache.advance(i)
        pixels = cache.pixels(shard)
        out.append(bytes(np.ascontiguousarray(pixels)) + cache.meta_bytes(shard))
        del pixels
    return out


@pytest.fixture
def dataset(tmp_path) -> str:
    directory = str(tmp_path / "ds")
    make_dataset(directory, inputs=(40, 45, 32), samples_per_shard=8)  # 15 shards, 3 of them partial
    return directory


def test_bytes_match_the_local_shards_and_each_shard_downloads_once(dataset, tmp_path):
    units, shape = units_of(dataset)
    store = FolderStore(dataset)
    cache = ShardCache(units, store, str(tmp_path / "cache"), 10**9, shape=shape)
    try:
        sequence = list(range(len(units))) + list(range(len(units)))[::-1]
        got = read_all(cache, sequence)
        for shard, data in zip(sequence, got):
            unit = units[shard]
            expected = local_pixels(dataset, unit).tobytes()
            expected += read_bytes(os.path.join(dataset, unit.meta_url[len(BASE) + 1:]))
            assert data == expected
        assert set(store.calls.values()) == {1} and len(store.calls) == 2 * len(units)
        assert cache.stats["downloads"] == len(units)
        assert cache.stats["hits"] + cache.stats["misses"] == 2 * len(sequence)  # pixels + meta each
    finally:
        cache.close()


def test_eviction_is_beladys_where_lru_would_differ(dataset, tmp_path):
    units, shape = units_of(dataset)
    a, b, c = units[0], units[1], units[2]  # 8 samples each
    limit = sum(sorted(u.size for u in units)[-2:])  # the least allowed: room for two, not three
    assert a.size + b.size + c.size > limit
    store = FolderStore(dataset)
    cache = ShardCache(units, store, str(tmp_path / "cache"), limit, shape=shape)
    try:
        # A B A C B: at C, LRU evicts B (used before the last A) and fetches it again; Belady evicts A
        # (never used again) and keeps B.
        read_all(cache, [0, 1, 0, 2, 1])
        assert store.calls[a.npy_url] == store.calls[b.npy_url] == store.calls[c.npy_url] == 1
        assert cache.stats["downloads"] == 3 and cache.stats["evictions"] == 1
        assert not os.path.exists(cache.path(a.key)) and os.path.exists(cache.path(b.key))
    finally:
        cache.close()


def test_the_directory_never_holds_more_than_the_limit(dataset, tmp_path):
    units, shape = units_of(dataset)
    cache_dir = str(tmp_path / "cache")
    store = FolderStore(dataset, cache_dir)
    limit = 3 * max(u.size for u in units)
    cache = ShardCache(units, store, cache_dir, limit, shape=shape, threads=3)
    try:
        rng = np.random.default_rng(7)
        sequence = [int(s) for s in rng.integers(0, len(units), size=60)]
        got = read_all(cache, sequence)
        assert len(store.sizes) > len(units)  # evictions forced downloads again
        assert max(store.sizes) <= limit
        assert 0 < cache.stats["peak_bytes"] <= limit
        for shard, data in zip(sequence, got):
            expected = local_pixels(dataset, units[shard]).tobytes()
            assert data[: units[shard].npy_bytes - HEADER_BYTES] == expected
    finally:
        cache.close()


def test_a_mapped_shard_is_kept_until_released(dataset, tmp_path):
    units, shape = units_of(dataset)
    limit = 2 * max(u.size for u in units)
    cache = ShardCache(units, FolderStore(dataset), str(tmp_path / "cache"), limit, shape=shape)
    try:
        cache.plan([[0], [1], [2]])
        held = [cache.pixels(0)]  # batches the program still holds
        cache.advance(1)
        held.append(cache.pixels(1))
        cache.advance(2)
        # Room for shard 2 needs the bytes of shard 0 or 1: doomed, not removed, while mapped.
        deadline = time.monotonic() + 30
        while cache.dooms == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        (doomed,) = cache.doomed()
        assert os.path.exists(cache.path(doomed))
        assert [h[0, 0, 0, 0] for h in held] == [0, 8]  # still readable
        del held
        assert bytes(np.ascontiguousarray(cache.pixels(2))) == local_pixels(dataset, units[2]).tobytes()
        assert not os.path.exists(cache.path(doomed))
        assert cache.stats["peak_bytes"] <= limit
    finally:
        cache.close()


def test_a_program_keeping_more_mapped_than_the_limit_gets_an_error_not_a_hang(dataset, tmp_path,
                                                                               monkeypatch):
    monkeypatch.setattr(shard_cache, "STUCK_TIMEOUT_S", 1.0)
    units, shape = units_of(dataset)
    least = sum(sorted(u.size for u in units)[-2:])
    cache = ShardCache(units, FolderStore(dataset), str(tmp_path / "cache"), least, shape=shape)
    try:
        cache.plan([[0], [1], [2]])
        held = [cache.pixels(0)]
        cache.advance(1)
        held.append(cache.pixels(1))
        cache.advance(2)
        with pytest.raises(ShardError, match="held by shards still memory-mapped"):
            cache.pixels(2)
        assert held
    finally:
        cache.close()


def test_a_download_failing_half_way_is_retried_and_never_used(dataset, tmp_path):
    units, shape = units_of(dataset)
    cache_dir = str(tmp_path / "cache")
    store = FolderStore(dataset, cache_dir, fail_first=1)
    cache = ShardCache(units, store, cache_dir, 10**9, shape=shape, threads=1)
    try:
        got = read_all(cache, [0])
        assert got[0][: units[0].npy_bytes - HEADER_BYTES] == local_pixels(dataset, units[0]).tobytes()
        assert cache.stats["retries"] == 1
        assert not [n for n in os.listdir(cache_dir) if n.startswith(".tmp-")]
    finally:
        cache.close()


_KILLED_CHILD = """
import os, sys, time
from shardio.read.cache.shard_cache import ShardCache
from tests.read.test_shard_cache import units_of

class Stuck:
    def download(self, path, local_path, algorithm):
        data = open(os.path.join(sys.argv[1], path.split("/ds/", 1)[1]), "rb").read()
        with open(local_path, "wb") as f:
            f.write(data[: len(data) // 2])
        open(sys.argv[3], "w").close()  # half written: kill me now
        time.sleep(600)

units, shape = units_of(sys.argv[1])
cache = ShardCache(units, Stuck(), sys.argv[2], 10**9, shape=shape, threads=1)
cache.plan([[0]])
cache.pixels(0)
"""


def test_a_download_killed_half_way_leaves_no_file_used_later(dataset, tmp_path):
    units, shape = units_of(dataset)
    cache_dir, marker = str(tmp_path / "cache"), str(tmp_path / "half-written")
    child = subprocess.Popen([sys.executable, "-c", _KILLED_CHILD, dataset, cache_dir, marker],
                             env={**os.environ, "PYTHONPATH": REPO})
    try:
        deadline = time.monotonic() + 60
        while not os.path.exists(marker) and time.monotonic() < deadline and child.poll() is None:
            time.sleep(0.05)
        assert os.path.exists(marker), "the child never started its download"
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.wait()
    leftovers = [n for n in os.listdir(cache_dir) if n.startswith(".tmp-")]
    assert leftovers and not os.path.exists(os.path.join(cache_dir, f"{units[0].key}.npy"))
    store = FolderStore(dataset)
    cache = ShardCache(units, store, cache_dir, 10**9, shape=shape)
    try:
        got = read_all(cache, [0])
        assert got[0][: units[0].npy_bytes - HEADER_BYTES] == local_pixels(dataset, units[0]).tobytes()
        assert cache.stats["downloads"] == 1 and cache.stats["adopted"] == 0
        assert not [n for n in os.listdir(cache_dir) if n.startswith(".tmp-")]  # the leftovers are gone
    finally:
        cache.close()


def _share_one_dir(dataset: str, cache_dir: str, out: str, order: int) -> None:
    units, shape = units_of(dataset)
    cache = ShardCache(units, FolderStore(dataset), cache_dir, 10**9, shape=shape, threads=2)
    sequence = list(range(len(units)))
    sequence = sequence if order == 0 else sequence[::-1]  # they meet in the middle
    got = read_all(cache, sequence)
    cache.close()
    checks = [data[: units[s].npy_bytes - HEADER_BYTES] == local_pixels(dataset, units[s]).tobytes()
              for s, data in zip(sequence, got)]
    with open(out, "w") as f:
        json.dump({"stats": cache.stats, "correct": all(checks)}, f)


def test_two_processes_sharing_a_cache_dir_download_each_shard_once(dataset, tmp_path):
    units, _ = units_of(dataset)
    cache_dir = str(tmp_path / "cache")
    context = multiprocessing.get_context("spawn")
    outs = [str(tmp_path / f"stats-{i}.json") for i in range(2)]
    procs = [context.Process(target=_share_one_dir, args=(dataset, cache_dir, outs[i], i)) for i in range(2)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(120)
        assert proc.exitcode == 0
    results = [json.loads(read_bytes(out)) for out in outs]
    assert all(r["correct"] for r in results)
    assert sum(r["stats"]["downloads"] for r in results) == len(units)
    assert sum(r["stats"]["adopted"] for r in results) == len(units)
    assert not [n for n in os.listdir(cache_dir) if n.startswith(".tmp-")]


def test_a_warm_cache_downloads_nothing(dataset, tmp_path):
    units, shape = units_of(dataset)
    cache_dir = str(tmp_path / "cache")
    for expected_downloads in (len(units), 0):
        store = FolderStore(dataset)
        cache = ShardCache(units, store, cache_dir, 10**9, shape=shape)
        read_all(cache, list(range(len(units))))
        cache.close()
        assert cache.stats["downloads"] == expected_downloads == sum(store.calls.values()) // 2
    # A file of the wrong size under its name (cut by someone) is not trusted: it is fetched again.
    with open(cache.path(units[3].key), "r+b") as f:
        f.truncate(100)
    with open(os.path.join(cache_dir, f".tmp-{units[5].key}.dead"), "wb") as f:  # a killed download's
        f.write(b"half")
    store = FolderStore(dataset)
    cache = ShardCache(units, store, cache_dir, 10**9, shape=shape)
    read_all(cache, [3])
    cache.close()
    assert cache.stats["downloads"] == 1
    assert not [n for n in os.listdir(cache_dir) if n.startswith(".tmp-")]  # no one was writing it


def test_a_corrupt_object_is_an_error_naming_its_url(dataset, tmp_path):
    units, shape = units_of(dataset)
    bad = units[2].npy_url
    store = FolderStore(dataset, corrupt=(bad,))
    cache = ShardCache(units, store, str(tmp_path / "cache"), 10**9, shape=shape, attempts=2)
    try:
        cache.plan([[0], [1], [2]])
        cache.pixels(0)
        with pytest.raises(ShardError, match=f"{bad}: xxh3_128 differs from the manifest"):
            cache.pixels(2)
        assert store.calls[bad] == 2  # retried, then reported
        assert not os.path.exists(cache.path(units[2].key))
    finally:
        cache.close()


def test_a_missing_object_is_an_error_naming_its_url(dataset, tmp_path):
    units, shape = units_of(dataset)
    gone = units[1].meta_url
    store = FolderStore(dataset, missing=(gone,))
    cache = ShardCache(units, store, str(tmp_path / "cache"), 10**9, shape=shape)
    try:
        cache.plan([[0], [1]])
        with pytest.raises(ShardError, match=f"{gone}: listed in the manifest but missing"):
            cache.meta_bytes(1)
        assert store.calls[gone] == 1  # not retried: a missing object stays missing
        cache.pixels(0)  # the others still read
    finally:
        cache.close()


def test_a_limit_below_two_shards_is_refused(dataset, tmp_path):
    units, shape = units_of(dataset)
    two = sum(sorted(u.size for u in units)[-2:])
    with pytest.raises(ValueError, match="cannot hold the two largest shards"):
        ShardCache(units, FolderStore(dataset), str(tmp_path / "cache"), two - 1, shape=shape)


def test_a_batch_wider_than_the_limit_is_refused(dataset, tmp_path):
    units, shape = units_of(dataset)
    cache = ShardCache(units, FolderStore(dataset), str(tmp_path / "cache"), 2 * max(u.size for u in units),
                       shape=shape)
    try:
        with pytest.raises(ShardError, match="needs 3 shards"):
            cache.plan([[0], [1, 2, 3]])
    finally:
        cache.close()


@pytest.mark.parametrize("buckets", [1, 3])
def test_a_cache_holding_the_whole_dataset_keeps_the_window(dataset, tmp_path, buckets):
    """15 shards, the last of each input shorter: a limit of exactly the dataset's bytes (the default)
    holds every shard, so the default window of 256 (two of which are more shards than there are) is
    kept, one window a bucket or one in all; a byte less and it is shrunk to what two windows fit."""
    import warnings

    from shardio.read.cache.cached_reading import fitting_window

    units, shape = units_of(dataset)
    total = sum(u.size for u in units)
    assert total < len(units) * max(u.size for u in units)  # partial shards: less than 15 of the largest
    whole = ShardCache(units, FolderStore(dataset), str(tmp_path / "cache"), total, shape=shape)
    short = ShardCache(units, FolderStore(dataset), str(tmp_path / "cache"), total - 1, shape=shape)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert fitting_window(256, True, whole, BASE, buckets) == 256
        with pytest.warns(UserWarning, match=f"raise cache_limit to {total} or pass"):
            assert fitting_window(256, True, short, BASE, buckets) < 256
    finally:
        whole.close()
        short.close()


def test_the_default_window_leaves_room_for_the_steps_a_group_reads_at_once(dataset, tmp_path):
    """Ranks sharing a cache directory read three steps of a batch on each of them at once (``shards_in_flight``): the
    default window is clamped to two windows and those shards, saying so; a rank alone keeps the two windows' rule."""
    import warnings

    from shardio.read.cache.cache_group import shards_in_flight
    from shardio.read.cache.cached_reading import fitting_window

    units, shape = units_of(dataset)
    largest = max(u.size for u in units)
    cache = ShardCache(units, FolderStore(dataset), str(tmp_path / "cache"), 10 * largest, shape=shape)
    try:
        assert shards_in_flight(1, 256, 64) == 0 and shards_in_flight(8, 256, 64) == 96
        assert shards_in_flight(2, 8, 8) == 6  # 3 steps of 2 batches of 8, shards of 8 samples
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert fitting_window(2, True, cache, BASE, 1, shards_in_flight(2, 8, 8)) == 2  # 4 + 6 shards fit
        with pytest.warns(UserWarning, match="and 6 shards for the steps its ranks read at once") as warned:
            assert fitting_window(256, True, cache, BASE, 1, 6) == 2
        assert "raise cache_limit to " in str(warned[0].message)
        with pytest.warns(UserWarning, match="using shuffle_window=5"):
            assert fitting_window(256, True, cache, BASE, 1, 0) == 5
        with pytest.warns(UserWarning, match="lower shuffle_window to 2"):
            assert fitting_window(3, False, cache, BASE, 1, 6) == 3  # a window the caller chose is kept
    finally:
        cache.close()


def test_a_warm_cache_on_a_read_only_file_system_reads_without_downloading(dataset, tmp_path, monkeypatch):
    """A cache directory on a read-only mount (EROFS), filled before: every shard is read from it, nothing
    downloaded, nothing removed; a shard missing there is a clear error at once, naming the directory."""
    units, shape = units_of(dataset)
    cache_dir = str(tmp_path / "cache")
    warm = ShardCache(units, FolderStore(dataset), cache_dir, 10**9, shape=shape)
    expected = read_all(warm, list(range(len(units))))
    warm.close()
    for name in os.listdir(cache_dir):
        if name.startswith(units[2].key):
            os.remove(os.path.join(cache_dir, name))
    before = sorted(os.listdir(cache_dir))
    make_read_only(monkeypatch, cache_dir)
    store = FolderStore(dataset)
    cache = ShardCache(units, store, cache_dir, 10**9, shape=shape)
    try:
        others = [s for s in range(len(units)) if s != 2]
        assert read_all(cache, others) == [expected[s] for s in others]
        assert store.calls == {} and cache.stats["downloads"] == 0
        with pytest.raises(ShardError, match=f"{cache_dir} is on a read-only file system.*cache_dir"):
            read_all(cache, [2])
        assert sum(store.calls.values()) <= 1  # not retried: waiting will not make the directory writable
    finally:
        cache.close()
    assert sorted(os.listdir(cache_dir)) == before


def test_a_directory_where_a_cached_file_belongs_is_a_clear_error_left_alone(dataset, tmp_path):
    units, shape = units_of(dataset)
    cache_dir = str(tmp_path / "cache")
    os.makedirs(os.path.join(cache_dir, f"{units[0].key}.npy", "someone's"))
    store = FolderStore(dataset)
    cache = ShardCache(units, store, cache_dir, 10**9, shape=shape)
    try:
        with pytest.raises(ShardError, match=f"{cache_dir}/{units[0].key}.npy: a directory where the shard "
                                             "cache keeps a file"):
            read_all(cache, [0])
        assert cache.stats["retries"] == 0
    finally:
        cache.close()
    assert os.path.isdir(os.path.join(cache_dir, f"{units[0].key}.npy", "someone's"))


def test_a_cache_directory_a_read_only_file_system_cannot_create_is_a_clear_error(dataset, tmp_path,
                                                                                  monkeypatch):
    units, shape = units_of(dataset)
    make_read_only(monkeypatch, str(tmp_path))
    cache_dir = str(tmp_path / "cache")
    with pytest.raises(ShardError, match=f"{cache_dir} is on a read-only file system"):
        ShardCache(units, FolderStore(dataset), cache_dir, 10**9, shape=shape)


def test_sizes_parse():
    assert parse_size(123) == 123
    assert parse_size("50GB") == 50 * 10**9
    assert parse_size("512MiB") == 512 * 2**20
    assert parse_size("1.5 tb") == 1.5 * 10**12
    for bad in ("lots", "-1GB", 0, True, "5 parsecs"):
        with pytest.raises(ValueError):
            parse_size(bad)


def test_a_cache_dir_is_trimmed_to_the_limit_of_files_no_one_holds(dataset, tmp_path):
    units, shape = units_of(dataset)
    cache_dir = str(tmp_path / "cache")
    cache = ShardCache(units, FolderStore(dataset), cache_dir, 10**9, shape=shape)
    read_all(cache, list(range(len(units))))
    cache.close()
    limit = 3 * max(u.size for u in units)
    cache = ShardCache(units, FolderStore(dataset), cache_dir, limit, shape=shape)
    try:
        cache.plan([[0], [1]])
        assert dir_bytes(cache_dir) <= limit
        assert os.path.exists(cache.path(units[0].key))  # the next needed are kept (warm)
    finally:
        cache.close()
    shutil.rmtree(cache_dir)


# --- shards with the same content (the same tar uploaded under two names) -------------------------------

@pytest.fixture
def twins(tmp_path) -> str:
    """Three inputs of 20 samples in shards of 8 (3 shards each) with the same pixels: ``copy.tar`` as
    ``input-0.tar`` with every ``.jsonl`` line naming its own tar (same ``.npy``, other ``.jsonl``);
    ``input-2.tar`` identical to ``input-0.tar`` in both files (its lines name ``input-0.tar`` too)."""
    directory = str(tmp_path / "twins")

    def meta_for(index: int, number: int, name: str) -> dict:
        tar = "copy.tar" if number == 1 else "input-0.tar"
        return {"key": f"s{index % 20:06d}", "tar": tar, "member": f"{index % 20}.jpg", "width": 8, "height": 8,
                "cls": index % 20, "txt": f"caption {index % 20}"}

    write_inputs(directory, (20, 20, 20), meta_for, height=8, width=8,
                 pixels_for=lambda index: self_identifying_pixels(index % 20, 8, 8))
    return directory


def local_bytes(directory: str, unit: CachedShard) -> bytes:
    return local_pixels(directory, unit).tobytes() + read_bytes(os.path.join(directory, unit.meta_url[len(BASE) + 1:]))


def test_twins_fixture_shares_pixels_and_some_metadata(twins):
    units, _ = units_of(twins)
    assert [u.npy_checksum for u in units[:3]] == [u.npy_checksum for u in units[3:6]] == \
        [u.npy_checksum for u in units[6:]]
    assert all(a.meta_checksum != b.meta_checksum for a, b in zip(units[:3], units[3:6]))
    assert [u.meta_checksum for u in units[:3]] == [u.meta_checksum for u in units[6:]]


def test_shards_with_the_same_pixels_and_other_metadata_each_read_their_own(twins, tmp_path):
    units, shape = units_of(twins)
    store = FolderStore(twins)
    cache = ShardCache(units, store, str(tmp_path / "cache"), 10**9, shape=shape)
    try:
        sequence = list(range(len(units)))
        for shard, data in zip(sequence, read_all(cache, sequence)):
            assert data == local_bytes(twins, units[shard]), f"shard {shard}"
        # Six different units (input-2's are input-0's, file for file): six downloads, not nine nor three.
        assert cache.stats["downloads"] == len({u.key for u in units}) == 6
    finally:
        cache.close()


def test_shards_sharing_both_files_share_one_unit_counted_once(twins, tmp_path):
    units, shape = units_of(twins)
    cache_dir = str(tmp_path / "cache")
    store = FolderStore(twins, cache_dir)
    limit = sum(sorted(u.size for u in units)[-2:])  # room for two units, not three
    cache = ShardCache(units, store, cache_dir, limit, shape=shape, threads=1)
    try:
        # 0 and 6 are one unit: 0 6 3 0 6 needs two units on disk, so nothing is evicted and nothing is
        # downloaded twice (a cache counting 6 apart would evict, and exceed nothing only by luck).
        sequence = [0, 6, 3, 0, 6]
        for shard, data in zip(sequence, read_all(cache, sequence)):
            assert data == local_bytes(twins, units[shard]), f"shard {shard}"
        assert cache.stats["downloads"] == 2 and cache.stats["evictions"] == 0
        assert cache.stats["peak_bytes"] == units[0].size + units[3].size <= limit
    finally:
        cache.close()


def test_twins_under_a_tight_limit_read_right_and_stay_under_it(twins, tmp_path):
    units, shape = units_of(twins)
    cache_dir = str(tmp_path / "cache")
    store = FolderStore(twins, cache_dir)
    limit = sum(sorted(u.size for u in units)[-2:])
    cache = ShardCache(units, store, cache_dir, limit, shape=shape, threads=3)
    try:
        rng = np.random.default_rng(11)
        sequence = [int(s) for s in rng.integers(0, len(units), size=60)]
        for shard, data in zip(sequence, read_all(cache, sequence)):
            assert data == local_bytes(twins, units[shard]), f"shard {shard}"
        assert cache.stats["evictions"] > 0
        assert max(store.sizes) <= limit and cache.stats["peak_bytes"] <= limit
    finally:
        cache.close()


def test_the_download_threads_come_from_the_environment_or_the_default(monkeypatch):
    from shardio.read.cache.cache_units import DOWNLOAD_THREADS, download_threads

    monkeypatch.delenv("SHARDIO_DOWNLOAD_THREADS", raising=False)
    assert download_threads() == DOWNLOAD_THREADS
    monkeypatch.setenv("SHARDIO_DOWNLOAD_THREADS", "16")
    assert download_threads() == 16
    for bad in ("0", "-2", "many"):
        monkeypatch.setenv("SHARDIO_DOWNLOAD_THREADS", bad)
        with pytest.raises(ValueError, match=rf"SHARDIO_DOWNLOAD_THREADS='{bad}': a whole number of threads"):
            download_threads()


def test_small_shards_get_more_download_threads_set_by_bytes_in_flight(monkeypatch):
    from shardio.read.cache.cache_units import (DOWNLOAD_BYTES_IN_FLIGHT, DOWNLOAD_THREADS, MAX_DOWNLOAD_THREADS,
                                                download_threads)

    monkeypatch.delenv("SHARDIO_DOWNLOAD_THREADS", raising=False)
    assert download_threads(DOWNLOAD_BYTES_IN_FLIGHT) == DOWNLOAD_THREADS  # large shards: pieces fetched at once
    assert download_threads(DOWNLOAD_BYTES_IN_FLIGHT // 16) == max(DOWNLOAD_THREADS, 16)
    assert download_threads(1024) == MAX_DOWNLOAD_THREADS
    monkeypatch.setenv("SHARDIO_DOWNLOAD_THREADS", "5")
    assert download_threads(1024) == 5


def test_a_follower_holds_two_steps_and_reads_what_the_leader_holds(dataset, tmp_path):
    """Two processes of a group plan the same steps (``shardio.read.cache.cache_group``): the leader downloads ahead
    within the whole limit, the follower holds no more than two of the largest steps, and both read every shard's
    own bytes."""
    units, shape = units_of(dataset)
    cache_dir = str(tmp_path / "cache")
    steps = [[0, 1], [2, 3], [1, 4], [5, 6], [7, 0], [8, 9], [10, 11], [12, 13], [14, 2]]
    largest = max(sum(units[s].size for s in step) for step in steps)
    leader = ShardCache(units, FolderStore(dataset), cache_dir, 10**9, shape=shape)
    follower = ShardCache(units, FolderStore(dataset), cache_dir, 10**9, shape=shape)
    try:
        leader.plan(steps, behind=2)
        follower.plan(steps, behind=2, lead=False)
        for number, step in enumerate(steps):
            for cache in (leader, follower):
                cache.advance(number)
                for shard in step:
                    assert bytes(np.ascontiguousarray(cache.pixels(shard))) == \
                        local_pixels(dataset, units[shard]).tobytes()
        assert 0 < follower.stats["peak_bytes"] <= 2 * largest < leader.stats["peak_bytes"]
        assert follower.stats["downloads"] + follower.stats["adopted"] >= len(units)
    finally:
        leader.close()
        follower.close()


def test_a_groups_leader_downloads_ahead_only_while_the_directory_has_room(dataset, tmp_path):
    """The processes of a group each hold at most their budget, but not always the same files (at a window's end one
    still holds the old window while the leader keeps the next): the leader counts the directory's files, everyone's,
    before a download ahead, so the directory stays within the limit; what a process reads now is never held back."""
    from shardio.read.cache.group_positions import GroupPositions

    units, shape = units_of(dataset)
    cache_dir = str(tmp_path / "cache")
    largest = max(u.size for u in units)
    other = ShardCache(units, FolderStore(dataset), cache_dir, 10**9, shape=shape)
    store = FolderStore(dataset, cache_dir)
    leader = ShardCache(units, store, cache_dir, 8 * largest, shape=shape, threads=3)
    try:
        read_all(other, [10, 11, 12, 13, 14])  # another process of the group still holds these
        held = dir_bytes(cache_dir)
        assert held > 4 * largest
        leader.plan([[s] for s in range(10)], lead=True, positions=GroupPositions(cache_dir, "g", 1, 0))
        _read_steps(leader, dataset, units, range(10))
        assert leader.stats["downloads"] == 10
        assert max(store.sizes) <= 8 * largest  # sampled at every download: never over the limit
        assert held + 3 * largest > max(store.sizes)  # ahead of what it read, at most the room the others left
    finally:
        leader.close()
        other.close()


def _read_steps(cache: ShardCache, dataset: str, units: list[CachedShard], steps: range) -> None:
    for number in steps:
        cache.advance(number)
        assert bytes(np.ascontiguousarray(cache.pixels(number))) == local_pixels(dataset, units[number]).tobytes()


def test_a_process_ahead_of_its_group_waits_for_room_instead_of_passing_the_limit(dataset, tmp_path):
    """A follower running ahead of the group's slowest process (its prefetch) reads past the group's keep set; the
    directory is full of what the slowest still reads, so its read waits until the slowest moves on and the group
    lets go of what it read: the directory stays within the limit (a shard, where both take the last room at once),
    and every byte read is the shard's own."""
    from shardio.read.cache.group_positions import GroupPositions

    units, shape = units_of(dataset)
    cache_dir = str(tmp_path / "cache")
    largest = max(u.size for u in units)
    limit = 6 * largest
    stores = [FolderStore(dataset, cache_dir), FolderStore(dataset, cache_dir)]
    leader, follower = (ShardCache(units, store, cache_dir, limit, shape=shape, threads=2) for store in stores)
    steps = [[s] for s in range(len(units))]
    slots = [GroupPositions(cache_dir, "g", 2, slot) for slot in range(2)]
    errors: list[BaseException] = []

    def run_ahead() -> None:
        try:
            _read_steps(follower, dataset, units, range(len(units)))
        except BaseException as e:  # noqa: BLE001 - raised in the test below
            errors.append(e)

    try:
        for cache, slot, lead in ((leader, slots[0], True), (follower, slots[1], False)):
            slot.begin(0, 0)
            cache.plan(steps, behind=2, lead=lead, positions=slot)
        _read_steps(leader, dataset, units, range(1))  # the slowest, at step 0, downloading its keep set ahead
        deadline = time.monotonic() + 60
        while dir_bytes(cache_dir) + largest <= limit and time.monotonic() < deadline:
            time.sleep(0.01)  # until the keep set fills the directory
        ahead = threading.Thread(target=run_ahead)
        ahead.start()
        ahead.join(timeout=1.0)
        assert ahead.is_alive() and not errors  # waiting for the group: the directory holds what the slowest reads
        assert dir_bytes(cache_dir) <= limit
        _read_steps(leader, dataset, units, range(1, len(units)))
        ahead.join(timeout=120)
        assert not ahead.is_alive() and not errors, errors
        # Sampled at every download. Two processes counting the directory at one moment may each take its last
        # room (each counts the other's downloads once they begin): one shard over at most.
        assert max(stores[0].sizes + stores[1].sizes) <= limit + largest
    finally:
        leader.close()
        follower.close()


def test_a_process_ahead_of_a_group_that_stopped_goes_ahead_after_a_while(dataset, tmp_path, monkeypatch):
    """The slowest process of the group stops mid-pass (never moves again): a process ahead of it waits
    ``HOLD_BACK_S`` for it, then reads on over the limit rather than hang."""
    from shardio.read.cache import cache_room
    from shardio.read.cache.group_positions import GroupPositions

    monkeypatch.setattr(cache_room, "HOLD_BACK_S", 0.5)
    units, shape = units_of(dataset)
    cache_dir = str(tmp_path / "cache")
    limit = 6 * max(u.size for u in units)
    leader, follower = (ShardCache(units, FolderStore(dataset), cache_dir, limit, shape=shape, threads=2)
                        for _ in range(2))
    steps = [[s] for s in range(len(units))]
    slots = [GroupPositions(cache_dir, "g", 2, slot) for slot in range(2)]
    try:
        for cache, slot, lead in ((leader, slots[0], True), (follower, slots[1], False)):
            slot.begin(0, 0)
            cache.plan(steps, behind=2, lead=lead, positions=slot)
        _read_steps(leader, dataset, units, range(1))  # and never again
        _read_steps(follower, dataset, units, range(len(units)))
        assert follower.stats["downloads"] > 0
    finally:
        leader.close()
        follower.close()


def test_a_group_member_that_never_begins_the_pass_does_not_stop_the_downloads_ahead(dataset, tmp_path,
                                                                                     monkeypatch):
    """A rank of the group opened the dataset and never iterates it (say, a validation set read on one rank): once
    it has not begun the pass for ``BEGIN_GRACE_S``, the others no longer keep what it would read at step 0, and the
    leader downloads ahead of where it reads, not only what it reads now."""
    from shardio.read.cache import group_positions
    from shardio.read.cache.group_positions import GroupPositions

    monkeypatch.setattr(group_positions, "BEGIN_GRACE_S", 0.0)
    units, shape = units_of(dataset)
    cache_dir = str(tmp_path / "cache")
    leader = ShardCache(units, FolderStore(dataset), cache_dir, 6 * max(u.size for u in units), shape=shape,
                        threads=2)
    steps = [[s] for s in range(len(units))]
    slot = GroupPositions(cache_dir, "g", 2, 0)  # slot 1's process never begins
    try:
        slot.begin(0, 0)
        leader.plan(steps, behind=2, lead=True, positions=slot)
        _read_steps(leader, dataset, units, range(9))
        ahead = [units[s] for s in (9, 10, 11)]
        deadline = time.monotonic() + 60
        while not all(leader.files.present(u) for u in ahead) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert all(leader.files.present(u) for u in ahead)  # downloaded before they are read
        _read_steps(leader, dataset, units, range(9, len(units)))
    finally:
        leader.close()
