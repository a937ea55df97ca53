"""A tar in a bucket is read while it downloads (preprocess.inputs.remote_tar), through a stand-in store.

The stand-in serves a local tar's bytes by ranged reads, counts and sizes them, and can hold a chunk back
until the test lets it go: so "decoding overlaps the download" is asserted by order of events (a sample
came out while a later chunk was still held), never by timing. The real server is in test_job_s3.py.
"""

from __future__ import annotations

import gzip
import os
import threading
from types import SimpleNamespace

import pytest

from preprocess.inputs import remote_tar
from preprocess.config import JobConfig
from preprocess.inputs.tar_samples import RawSample, index_tar, iter_tar_samples
from preprocess.worker import process_input
from shardio.store import scratch as scratch_folder
from shardio.store import backends
from shardio.store.backends import for_path
from shardio.errors import InputError
from tests.tar_factory import read_shards

IMAGE_EXTENSIONS = ("jpg", "png")
CHUNK = 4096
URL = "s3://bucket/drop/0001.tar"


class FakeObject:
    """One object: ``read_range`` as a store serves it, with an optional gate and a failure to inject."""

    is_local = False

    def __init__(self, data: bytes, etag: str = "etag-1") -> None:
        self.data, self.etag = data, etag
        self.ranges: list[tuple[int, int]] = []
        self.hold_from: int | None = None  # chunks starting at or after this offset wait for `release`
        self.release = threading.Event()
        self.fail_at: int | None = None  # a read starting at or after this offset fails for good
        self.served = threading.Condition()

    def file_size(self, url: str) -> int:
        assert url == URL
        return len(self.data)

    def read_range(self, url: str, start: int, length: int) -> bytes:
        assert url == URL
        if self.hold_from is not None and start >= self.hold_from:
            assert self.release.wait(30), "the test never released the held chunk"
        if self.fail_at is not None and start >= self.fail_at:
            raise ConnectionResetError("connection reset by peer (after the client's retries)")
        with self.served:
            self.ranges.append((start, length))
            self.served.notify_all()
        return self.data[start:start + length]

    def info(self, url: str) -> SimpleNamespace:  # a FileInfo's fields
        return SimpleNamespace(path=url, size=len(self.data), mtime_ns=0, version=self.etag)


@pytest.fixture
def scratch(tmp_path, monkeypatch) -> str:
    path = str(tmp_path / "scratch")
    monkeypatch.setenv("SHARDIO_SCRATCH", path)
    monkeypatch.setattr(scratch_folder, "_SCRATCH", None)  # the process's scratch folder, found again
    monkeypatch.setattr(remote_tar, "CHUNK_BYTES", CHUNK)
    return path


def _files_under(folder: str) -> list[str]:
    """What an input left in scratch: every file but the process folder's own lock (``.owner``)."""
    return [os.path.join(d, f) for d, _, files in os.walk(folder) for f in files if f != scratch_folder.OWNER_FILE]


def _serve(monkeypatch, data: bytes, etag: str = "etag-1") -> FakeObject:
    fake = FakeObject(data, etag)
    monkeypatch.setitem(backends._OPEN, "s3", fake)  # the process's s3:// backend, from the one table
    return fake


def _open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def _samples(path: str, **kwargs) -> list:
    return list(iter_tar_samples(path, IMAGE_EXTENSIONS, **kwargs))


def test_samples_come_out_while_later_chunks_are_still_downloading(tars, scratch, monkeypatch):
    path = tars.make("0001.tar", range(40))
    data = open(path, "rb").read()
    assert len(data) > 8 * CHUNK
    fake = _serve(monkeypatch, data)
    fake.hold_from = 4 * CHUNK
    samples = iter_tar_samples(URL, IMAGE_EXTENSIONS, size=len(data), etag="etag-1")
    first = next(samples)
    # A sample was decoded from the first chunks while the fifth was still held back by the "network".
    assert isinstance(first, RawSample) and first.key == "000000"
    assert max(start for start, _ in fake.ranges) < 4 * CHUNK
    assert _files_under(scratch) == []  # the spool has no name: nothing to leave behind
    fake.release.set()
    rest = list(samples)
    assert [first, *rest] == _samples(path)  # the same samples, in the same order, as from local disk
    # Memory stays bounded: chunks of at most CHUNK bytes (FETCHERS in flight), each byte asked for once.
    assert sorted(fake.ranges) == remote_tar.chunk_plan(len(data), CHUNK)
    assert all(length <= CHUNK for _, length in fake.ranges)


def test_memory_stays_at_the_window_however_large_the_object(scratch, monkeypatch):
    """Read front to back with jumps (a long member skipped): the window holds at most BACK_BYTES behind the
    furthest read, the read itself and WINDOW_CHUNKS chunks ahead of it, and no chunk is asked for twice."""
    monkeypatch.setattr(remote_tar, "BACK_BYTES", 2 * CHUNK)
    data = os.urandom(200 * CHUNK)
    fake = FakeObject(data)
    # behind, the longest read itself (9 chunks), the chunks ahead of it and one landing
    bound = remote_tar.BACK_BYTES + 9 * CHUNK + (remote_tar.WINDOW_CHUNKS + 1) * CHUNK
    held = []
    with remote_tar.SpooledObject(URL, len(data), backend=fake) as spool:
        offset = 0
        while offset < len(data):
            length = 700 if offset % (40 * CHUNK) else 9 * CHUNK  # now and then one read over several chunks
            assert spool.pread(length, offset) == data[offset:offset + length]
            held.append(spool.held_bytes)
            offset += length + (30 * CHUNK if offset % 7 == 0 else 0)  # and now and then a jump
        spool.finish()
    assert max(held) <= bound
    assert sorted(fake.ranges) == remote_tar.chunk_plan(len(data), CHUNK)


def test_a_read_behind_the_window_is_fetched_again_and_right(scratch, monkeypatch):
    monkeypatch.setattr(remote_tar, "BACK_BYTES", CHUNK)
    data = os.urandom(64 * CHUNK)
    fake = FakeObject(data)
    with remote_tar.SpooledObject(URL, len(data), backend=fake) as spool:
        assert spool.pread(100, 40 * CHUNK) == data[40 * CHUNK:40 * CHUNK + 100]
        asked = len(fake.ranges)
        assert spool.pread(5000, 10) == data[10:5010]  # long let go: one ranged GET of exactly this
        assert fake.ranges[asked:] == [(10, 5000)]
        assert spool.read_some(1 << 20, 40 * CHUNK + 100)[:50] == data[40 * CHUNK + 100:40 * CHUNK + 150]
        spool.finish()


def test_chunks_ramp_up_to_the_chunk_size_and_cover_the_object_once():
    plan = remote_tar.chunk_plan(20 << 20, 8 << 20)
    assert [length >> 20 for _, length in plan] == [1, 2, 4, 8, 5]
    assert [offset for offset, _ in plan] == [0, 1 << 20, 3 << 20, 7 << 20, 15 << 20]
    assert remote_tar.chunk_plan(100, 8 << 20) == [(0, 100)]


def test_nothing_is_left_open_or_in_scratch_however_the_input_ends(tars, scratch, monkeypatch):
    path = tars.make("0001.tar", range(20))
    data = open(path, "rb").read()
    fake = _serve(monkeypatch, data)
    scratch_folder.scratch_dir()  # the process's folder and its lock: made once, held for its life
    before = _open_fds()
    _samples(URL, size=len(data))  # read to the end
    assert _open_fds() == before
    early = iter_tar_samples(URL, IMAGE_EXTENSIONS, size=len(data))
    next(early)
    early.close()  # cancelled mid-way (a cancelled task, a stop request)
    fake.fail_at = 2 * CHUNK
    with pytest.raises(InputError):
        _samples(URL, size=len(data))  # failed mid-way
    deadline = threading.Event()
    for _ in range(100):  # a download thread ends when its request returns: bounded wait
        if _open_fds() == before:
            break
        deadline.wait(0.05)
    assert _open_fds() == before
    assert _files_under(scratch) == []


def test_a_persistent_download_error_fails_the_input_naming_url_and_reason(tars, scratch, monkeypatch):
    path = tars.make("0001.tar", range(30))
    data = open(path, "rb").read()
    fake = _serve(monkeypatch, data)
    fake.fail_at = 3 * CHUNK
    with pytest.raises(InputError) as caught:
        _samples(URL, size=len(data))
    message = str(caught.value)
    assert message.startswith(f"{URL}: download failed at byte ") and f" of {len(data)}: " in message
    reached = int(message.split("download failed at byte ")[1].split(" ")[0])
    first_failing = min(offset for offset, _ in remote_tar.chunk_plan(len(data), CHUNK) if offset >= 3 * CHUNK)
    # What had arrived in order when it failed: the fetchers run concurrently, so the failing range can
    # come back before the first one has landed (0 then; seen once on a loaded machine).
    assert 0 <= reached <= first_failing
    assert "connection reset by peer" in message


def test_an_object_replaced_while_read_is_not_committed(tars, scratch, monkeypatch, tmp_path):
    path = tars.make("0001.tar", range(10))
    data = open(path, "rb").read()
    _serve(monkeypatch, data, etag="etag-2")  # the store now has another version than the LIST said
    cfg = JobConfig(height=16, width=16, samples_per_shard=4)
    out = str(tmp_path / "out")
    os.makedirs(os.path.join(out, "shards"))
    result = process_input(URL, out, cfg, (len(data), 0, "etag-1"))
    assert result.error is not None and "replaced while it was read" in result.error and result.shards == []
    assert os.listdir(os.path.join(out, "shards")) == []  # all or nothing per input


def test_a_truncated_remote_tar_fails_with_the_local_reason(tars, scratch, monkeypatch):
    path = tars.make("0001.tar", range(10))
    cut = tars.derive("cut.tar", path, lambda b: b[: len(b) // 2])
    data = open(cut, "rb").read()
    _serve(monkeypatch, data)
    with pytest.raises(InputError) as local:
        _samples(cut)
    with pytest.raises(InputError) as remote:
        _samples(URL, size=len(data))
    assert remote.value.reason == local.value.reason


def test_a_gzipped_tar_streams_from_the_download(tars, scratch, monkeypatch):
    path = tars.make("0001.tar", range(25))
    gz = tars.derive("0001.tar.gz", path, gzip.compress)
    data = open(gz, "rb").read()
    fake = _serve(monkeypatch, data)
    url = URL
    # The reader decides by content (tarfile's r:*), as locally: the .tar name does not matter.
    assert _samples(url, size=len(data)) == _samples(path)
    assert sum(length for _, length in fake.ranges) == len(data)


def test_the_same_tar_local_or_remote_gives_the_same_pixels_and_rows(tars, scratch, monkeypatch, tmp_path):
    path = tars.make("0001.tar", range(23))
    data = open(path, "rb").read()
    _serve(monkeypatch, data)
    cfg = JobConfig(height=24, width=24, samples_per_shard=8)
    results = {}
    for name, source, fingerprint in (("local", path, for_path(path).stat_fingerprint(path)),
                                      ("remote", URL, (len(data), 0, "etag-1"))):
        out = str(tmp_path / name)
        os.makedirs(os.path.join(out, "shards"))
        result = process_input(source, out, cfg, fingerprint)
        assert result.error is None and result.samples == 23
        results[name] = (out, result)
    (local_out, local), (remote_out, remote) = results["local"], results["remote"]
    local_pixels, local_rows = read_shards(local_out, local.shards)
    remote_pixels, remote_rows = read_shards(remote_out, remote.shards)
    assert local_pixels.tobytes() == remote_pixels.tobytes()
    assert [{**r, "tar": None} for r in local_rows] == [{**r, "tar": None} for r in remote_rows]
    assert {r["tar"] for r in remote_rows} == {URL}
    assert [s["samples"] for s in local.shards] == [s["samples"] for s in remote.shards] == [8, 8, 7]


def test_an_object_is_indexed_like_the_same_local_tar(tars, scratch, monkeypatch):
    path = tars.make("0001.tar", range(12))
    data = open(path, "rb").read()
    _serve(monkeypatch, data)
    remote = index_tar(URL)
    assert remote is not None and remote.path == URL and remote.members == index_tar(path).members


def test_a_burst_of_503s_on_the_ranged_gets_is_retried_by_the_client(s3_server, s3_bucket, tars, scratch,
                                                                     monkeypatch, tmp_path):
    """The real client against the real server, through a proxy that answers SlowDown to the first ranged
    GETs: obstore's retries ride it out and the input gives the same pixels as from local disk."""
    from shardio.store.s3 import S3Storage
    from tests.fault_proxy import FaultProxy

    path = tars.make("0001.tar", range(30))
    key = "in/0001.tar"
    s3_server.client().upload_file(path, s3_bucket, key)
    url = f"s3://{s3_bucket}/{key}"
    proxy = FaultProxy(s3_server.ports["s3"])
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        monkeypatch.setitem(backends._OPEN, "s3", S3Storage())  # a client that talks through the proxy
        [info] = for_path(f"s3://{s3_bucket}/in").list_files(f"s3://{s3_bucket}/in")  # as the job finds it
        assert for_path(url).info(url) == info
        proxy.fail_next(4)  # the first ranged GETs meet 503 SlowDown
        cfg = JobConfig(height=16, width=16, samples_per_shard=8)
        results = {}
        for name, source, fingerprint in (("remote", url, (info.size, info.mtime_ns, info.version)),
                                          ("local", path, for_path(path).stat_fingerprint(path))):
            out = str(tmp_path / name)
            os.makedirs(os.path.join(out, "shards"))
            result = process_input(source, out, cfg, fingerprint)
            assert result.error is None, result.error
            results[name] = read_shards(out, result.shards)[0]
        assert proxy.failed == 4
        assert any(m.startswith("GET") for m in proxy.methods)
    finally:
        proxy.close()
    assert results["remote"].tobytes() == results["local"].tobytes()
