"""``Storage.download`` on every cloud (``shardio.store.piece_download``): the object fetched in pieces at
once, written at their offsets, byte for byte what was uploaded at every size around the piece size (empty,
one byte, a piece less one, a piece, a piece and one, several), its checksum the file's; a missing object is
``FileNotFoundError``; a download that fails leaves an empty file, never one of the right size with a hole."""

from __future__ import annotations

import os

import pytest

from shardio.errors import StorageUnavailable
from shardio.store import backends, piece_download
from shardio.store.checksum import file_checksum
from tests.fault_proxy import proxied_env, proxy_for, shorten_retries

PIECE = 1024


@pytest.fixture
def small_pieces(monkeypatch) -> None:
    monkeypatch.setattr(piece_download, "PIECE_BYTES", PIECE)


def test_every_size_downloads_byte_for_byte(cloud_bucket, tmp_path, small_pieces):
    storage = backends.for_path(cloud_bucket.url())
    for size in (0, 1, PIECE - 1, PIECE, PIECE + 1, 5 * PIECE + 7, 40 * PIECE):
        source = tmp_path / f"source-{size}"
        source.write_bytes(os.urandom(size))
        cloud_bucket.server.put_file(cloud_bucket.name, f"o/{size}", str(source))
        target = tmp_path / "copy"
        digest = storage.download(cloud_bucket.url(f"o/{size}"), str(target), "xxh3_128")
        assert target.read_bytes() == source.read_bytes(), size
        assert digest == file_checksum(str(source), "xxh3_128")
    with pytest.raises(FileNotFoundError):
        storage.download(cloud_bucket.url("o/missing"), str(tmp_path / "missing"), "xxh3_128")


def test_a_failed_download_leaves_an_empty_file(cloud_bucket, tmp_path, small_pieces, monkeypatch):
    source = tmp_path / "source"
    source.write_bytes(os.urandom(8 * PIECE))
    cloud_bucket.server.put_file(cloud_bucket.name, "o/cut", str(source))
    proxy = proxy_for(cloud_bucket.server)
    try:
        for name, value in proxied_env(cloud_bucket.server, proxy, str(tmp_path)).items():
            monkeypatch.setenv(name, value)
        monkeypatch.setattr(backends, "_OPEN", {})
        shorten_retries(monkeypatch)
        storage = backends.for_path(cloud_bucket.url())
        target = tmp_path / "copy"
        storage.download(cloud_bucket.url("o/cut"), str(target), "xxh3_128")  # nothing cut: whole
        assert target.read_bytes() == source.read_bytes()
        proxy.cut_next(10**6, "o/cut", after=1)  # the first piece (and the size) comes, every later one is cut
        with pytest.raises(StorageUnavailable, match="o/cut"):
            storage.download(cloud_bucket.url("o/cut"), str(target), "xxh3_128")
        assert target.stat().st_size == 0
        proxy.cut_next(10**6, "o/cut")  # the first piece too
        target.write_bytes(source.read_bytes())
        with pytest.raises(StorageUnavailable, match="o/cut"):
            storage.download(cloud_bucket.url("o/cut"), str(target), "xxh3_128")
        assert target.stat().st_size == 0
        assert proxy.cut >= 2
    finally:
        proxy.close()
