"""A cold epoch through a misbehaving store, on every cloud (S3, GCS and Azure emulators behind
``tests/fault_proxy.py``): a download cut mid-stream, a burst of 503s, bytes flipped on the way, a slow
server, and a server that dies mid-epoch (and one that comes back). Each ends with the local copy's exact
batches (the fault was retried) or a ``ShardError`` naming the object's URL within a bound (never a hang,
never a wrong pixel). And four rank processes sharing one ``cache_dir`` GET each object once, counted by the
proxy.

The shards are a few KB and the download's pieces are made 2 KB here, so every shard is fetched in several
ranged GETs at once (``shardio.store.piece_download``: the pieces, the fetch threads) and a fault can land on
any of them. The faults are counted requests, not timings: a test waits on nothing but the outcome. The
failing cases shorten obstore's retries (a few seconds instead of a minute) so the bound is quick to check;
the bound itself is the module docstring of ``shardio.store.piece_download``.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import pytest
import torch

from shardio.errors import ShardError
from shardio.format.manifests import load_manifest
from shardio.read.dataset import ShardDataset
from shardio.store import backends, object_store, piece_download
from tests.dataset_fixtures import indices, make_dataset
from tests.fault_proxy import FaultProxy, proxied_env, proxy_for, shorten_retries

SETTINGS = {"shuffle": True, "seed": 5, "shuffle_window": 4, "shuffle_block": 4, "drop_last": False}
FAILED_WITHIN_S = 120  # generous: the shortened retries take a few seconds on an idle machine


@pytest.fixture
def local(tmp_path) -> str:
    directory = str(tmp_path / "local")
    make_dataset(directory, inputs=(40, 45, 32), samples_per_shard=8, height=16, width=16)  # 15 shards
    return directory


@pytest.fixture
def through_proxy(cloud_bucket, local, tmp_path, monkeypatch) -> Any:
    """(the dataset's URL, the proxy in front of its server): the client talks to the proxy only, with a
    backend made for this test, and downloads come in pieces of 2 KB."""
    url = cloud_bucket.upload_dir(local)
    proxy = proxy_for(cloud_bucket.server)
    for name, value in proxied_env(cloud_bucket.server, proxy, str(tmp_path)).items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(backends, "_OPEN", {})  # a new client, which reads the variables above
    monkeypatch.setattr(piece_download, "PIECE_BYTES", 2048)
    yield url, proxy
    proxy.close()


@pytest.fixture
def fast_retries(monkeypatch) -> None:
    shorten_retries(monkeypatch)


def assert_reads_the_local_copy(local: str, url: str, cache_dir: str) -> dict[str, int]:
    expected = list(ShardDataset(local, 8, **SETTINGS))
    remote = ShardDataset(url, 8, cache_dir=cache_dir, **SETTINGS)
    got = list(remote)
    assert len(got) == len(expected)
    for a, b in zip(expected, got):
        assert torch.equal(a["image"], b["image"]) and a["__key__"] == b["__key__"]
        indices(b)  # pixels, labels and keys agree
    return remote.cache_stats()


def failing_read(url: str, cache_dir: str) -> tuple[str, float]:
    """The ``ShardError`` message of an epoch that must fail, and how long it took."""
    began = time.monotonic()
    with pytest.raises(ShardError) as raised:
        list(ShardDataset(url, 8, cache_dir=cache_dir, **SETTINGS))
    return str(raised.value), time.monotonic() - began


def shard_url(local: str, url: str, index: int) -> str:
    return f"{url}/{load_manifest(local).shards[index].path}"


def test_a_download_cut_mid_stream_is_fetched_again(through_proxy, local, tmp_path):
    url, proxy = through_proxy
    proxy.cut_next(4, "/shards/")
    assert_reads_the_local_copy(local, url, str(tmp_path / "cache"))
    assert proxy.cut == 4


def test_a_shard_cut_on_every_attempt_is_an_error_naming_it(through_proxy, local, tmp_path, fast_retries):
    url, proxy = through_proxy
    target = shard_url(local, url, 3)
    proxy.cut_next(10**6, target.split("/ds/", 1)[1])
    message, seconds = failing_read(url, str(tmp_path / "cache"))
    assert target in message and seconds < FAILED_WITHIN_S
    assert not [n for n in os.listdir(tmp_path / "cache") if n.startswith(".tmp-")]


def test_a_storm_of_503s_is_ridden_out(through_proxy, local, tmp_path, fast_retries):
    # 3 tries a request x 3 a piece x 3 a shard: a burst of fewer than 27 errors always ends in success.
    url, proxy = through_proxy
    proxy.fail_next(20, fragment="/shards/")
    assert_reads_the_local_copy(local, url, str(tmp_path / "cache"))
    assert proxy.failed == 20


def test_a_shard_answered_503_for_good_is_an_error_naming_it(through_proxy, local, tmp_path, fast_retries):
    url, proxy = through_proxy
    target = shard_url(local, url, 7)
    proxy.fail_matching(target.split("/ds/", 1)[1])
    message, seconds = failing_read(url, str(tmp_path / "cache"))
    assert target in message and seconds < FAILED_WITHIN_S


def test_bytes_flipped_on_the_way_are_caught_and_fetched_again(through_proxy, local, tmp_path):
    url, proxy = through_proxy
    proxy.corrupt_next(3, "/shards/")
    stats = assert_reads_the_local_copy(local, url, str(tmp_path / "cache"))
    assert proxy.corrupted == 3 and stats["retries"] >= 1


def test_a_slow_server_is_waited_for(through_proxy, local, tmp_path):
    url, proxy = through_proxy
    proxy.delay_matching("/shards/", 1.0)  # a second before every shard request
    assert_reads_the_local_copy(local, url, str(tmp_path / "cache"))
    assert proxy.delayed > 15


def test_a_server_slower_than_the_request_timeout_is_an_error_naming_the_shard(through_proxy, local, tmp_path,
                                                                             fast_retries, monkeypatch):
    url, proxy = through_proxy
    monkeypatch.setitem(object_store.CLIENT_OPTIONS, "timeout", "1s")
    target = shard_url(local, url, 2)
    proxy.delay_matching(target.split("/ds/", 1)[1], 4.0)  # never answered within the timeout
    message, seconds = failing_read(url, str(tmp_path / "cache"))
    assert target in message and seconds < FAILED_WITHIN_S


def test_a_server_dying_mid_epoch_is_an_error_naming_a_shard(through_proxy, local, tmp_path, fast_retries):
    url, proxy = through_proxy
    proxy.die_after(6, "/shards/")
    message, seconds = failing_read(url, str(tmp_path / "cache"))
    assert f"{url}/shards/" in message and seconds < FAILED_WITHIN_S


def test_a_server_back_within_the_retries_is_ridden_out(through_proxy, local, tmp_path):
    # The default retries (a minute) outlast a server away for a second.
    url, proxy = through_proxy
    proxy.die_after(6, "/shards/")

    def back() -> None:
        while proxy.forwarded == 0 or not _down(proxy):
            time.sleep(0.05)
        time.sleep(1.0)
        proxy.come_back()

    returner = threading.Thread(target=back, daemon=True)
    returner.start()
    stats = assert_reads_the_local_copy(local, url, str(tmp_path / "cache"))
    returner.join(60)
    assert not returner.is_alive() and stats["downloads"] == 15


def _down(proxy: FaultProxy) -> bool:
    import socket

    try:
        socket.create_connection(("127.0.0.1", proxy.port), timeout=1).close()
        return False
    except OSError:
        return True


def _rank_epoch(url: str, cache_dir: str, limit: int, rank: int, world: int, rendezvous: str, out: str) -> None:
    """Rank ``rank`` of ``world`` under torch.distributed (gloo), in lockstep as under DDP (a barrier after every
    batch), reading one epoch through ``cache_dir``."""
    import json

    import torch.distributed as dist

    from tests.dataset_fixtures import indices as sample_indices

    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    try:
        ds = ShardDataset(url, 1, cache_dir=cache_dir, cache_limit=limit, prefetch=0,
                          **{**SETTINGS, "shuffle_window": 2, "drop_last": True})
        seen = []
        for batch in ds:
            seen += [int(i) for i in sample_indices(batch)]
            dist.barrier()
        cache = ds._cache
        assert cache is not None
        with open(out, "w") as f:
            json.dump({"seen": seen, "stats": ds.cache_stats(), "planned": cache.plan_digest}, f)
    finally:
        dist.destroy_process_group()


def test_four_rank_processes_sharing_a_cache_dir_get_each_object_once(cloud_bucket, local, tmp_path, monkeypatch):
    """Ranks of a node under torch.distributed find they share the directory and plan the node's reads together:
    with a cache of a third of the dataset each shard is fetched once an epoch (each rank planning only its own
    batches fetched one again once every rank had let it go)."""
    import json
    import multiprocessing

    import numpy as np


    url = cloud_bucket.upload_dir(local)
    shards = load_manifest(local).shards
    limit = 5 * max(e.bytes + e.meta_bytes for e in shards)  # 5 of 15 shards: two windows of 2, and one more
    proxy = proxy_for(cloud_bucket.server)
    try:
        for name, value in proxied_env(cloud_bucket.server, proxy, str(tmp_path)).items():
            monkeypatch.setenv(name, value)  # the spawned ranks inherit them: they talk to the proxy only
        context = multiprocessing.get_context("spawn")
        cache, world, rendezvous = str(tmp_path / "cache"), 4, str(tmp_path / "rendezvous")
        outs = [str(tmp_path / f"rank-{rank}.json") for rank in range(world)]
        ranks = [context.Process(target=_rank_epoch, args=(url, cache, limit, rank, world, rendezvous, outs[rank]))
                 for rank in range(world)]
        for process in ranks:
            process.start()
        for process in ranks:
            process.join(300)
            assert process.exitcode == 0
        results = []
        for out in outs:
            with open(out) as f:
                results.append(json.load(f))
        got = np.array([i for r in results for i in r["seen"]])
        counts = proxy.get_counts("/shards/")
    finally:
        proxy.close()
    assert len(got) == len(set(got.tolist())) == 116  # 29 rounds of 4, the last sample dropped
    # Every rank planned the node's reads: the same steps, in the same order (every shard of the epoch is
    # fetched once, below).
    assert all(r["planned"] == results[0]["planned"] for r in results)
    assert len(counts) == 2 * len(shards) and set(counts.values()) == {1}, counts  # every .npy and .jsonl once
    assert sum(r["stats"]["downloads"] for r in results) == len(shards)
    assert sum(r["stats"]["adopted"] for r in results) > 0  # the ranks met on shards: one fetched, others adopted
    assert all(0 < r["stats"]["peak_bytes"] <= limit for r in results)
