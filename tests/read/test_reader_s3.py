"""``ShardDataset("s3://...")`` end to end against the session's SeaweedFS server: the dataset is written
locally with the test writer, uploaded with boto3, and read back through the shard cache.

Checked: the same batches, byte for byte, as the local copy (several epochs, two ranks, shuffled, with a
limit that forces evictions, and with DataLoader workers sharing one cache directory); the cache never
holds more than its limit; a warm cache downloads nothing; a corrupt object and a missing one are clear
errors naming the URL; cache arguments on a local path and a limit below two shards are refused; the same
tar uploaded under two names (shards with the same pixels) reads whole at every shuffle and cache size. A
bucketed dataset reads each shard at its bucket's shape, refuses a shard whose header says another bucket,
and fits a cache window of every bucket.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import warnings
from collections import Counter

import numpy as np
import pytest
import torch

from shardio.read.dataset import ShardDataset
from shardio.errors import ShardError, ShardIntegrityError
from shardio.format.manifests import load_index, load_manifest, read_root
from shardio.read.snapshot import open_dataset
from shardio.train.loader import ShardLoader
from tests.bucket_fixtures import BUCKETS, make_bucketed_dataset
from tests.index_steps import compacted_and_collected
from tests.read.test_dataset_generations import stale_reads
from tests.dataset_fixtures import assert_exactly_once, indices, make_dataset, self_identifying_pixels, write_inputs
from tests.layout_fixtures import READ_BUCKETS, Layout, every_key


def upload(s3_server, bucket: str, directory: str, prefix: str = "ds") -> str:
    client = s3_server.client()
    for base, _, files in os.walk(directory):
        for name in files:
            path = os.path.join(base, name)
            key = f"{prefix}/{os.path.relpath(path, directory)}"
            client.upload_file(path, bucket, key)
    return f"s3://{bucket}/{prefix}"


@pytest.fixture
def local(tmp_path, encoding: str) -> str:
    directory = str(tmp_path / "local")
    make_dataset(directory, inputs=(40, 45, 32), samples_per_shard=8, height=16, width=16, encoding=encoding)
    return directory


@pytest.fixture
def remote(s3_server, s3_bucket, local) -> str:
    return upload(s3_server, s3_bucket, local)


def shard_bytes(directory: str) -> list[int]:
    return [e.bytes + e.meta_bytes for e in load_manifest(directory).shards]


def same_batch(a: dict, b: dict) -> None:
    assert torch.equal(a["image"], b["image"])
    assert a["__key__"] == b["__key__"] and a["txt"] == b["txt"] and torch.equal(a["cls"], b["cls"])


SETTINGS = {"shuffle": True, "seed": 3, "shuffle_window": 3, "shuffle_block": 4, "drop_last": False}


def test_batches_from_the_bucket_equal_the_local_ones(local, remote, tmp_path):
    limit = 5 * max(shard_bytes(local))  # 5 of 15 shards: evictions every epoch
    for rank in range(2):
        here = ShardDataset(local, 8, rank=rank, world_size=2, **SETTINGS)
        with pytest.warns(UserWarning, match="more than once an epoch"):  # meant to: evictions
            there = ShardDataset(remote, 8, rank=rank, world_size=2, cache_dir=str(tmp_path / "cache"),
                                 cache_limit=limit, **SETTINGS)
        for epoch in range(3):
            here.set_epoch(epoch)
            there.set_epoch(epoch)
            expected, got = list(here), list(there)
            assert len(got) == len(expected) == len(there)
            for a, b in zip(expected, got):
                same_batch(a, b)
                indices(b)  # labels, keys and pixels agree
        stats = there.cache_stats()
        assert stats is not None and 0 < stats["peak_bytes"] <= limit
        assert stats["evictions"] > 0 and stats["downloads"] + stats["adopted"] > len(shard_bytes(local))


def test_every_sample_once_per_epoch_over_ranks(local, remote, tmp_path):
    seen = []
    for rank in range(2):
        ds = ShardDataset(remote, 10, rank=rank, world_size=2, cache_dir=str(tmp_path / "cache"),
                          cache_limit="1MiB", **SETTINGS)
        seen += [indices(b) for b in ds]
    assert_exactly_once(np.concatenate(seen), 117)


def test_a_warm_cache_downloads_nothing_and_reads_the_same(local, remote, tmp_path):
    cache = str(tmp_path / "cache")
    first = ShardDataset(remote, 16, cache_dir=cache, cache_limit="10MB")
    cold = list(first)
    assert first.cache_stats()["downloads"] == 15
    second = ShardDataset(remote, 16, cache_dir=cache, cache_limit="10MB")
    warm = list(second)
    stats = second.cache_stats()
    assert stats["downloads"] == 0 and stats["adopted"] == 15 and stats["bytes_downloaded"] == 0
    for a, b in zip(cold, warm):
        same_batch(a, b)


def test_dataloader_workers_share_one_cache_dir(local, remote, tmp_path):
    # ShardLoader spawns its workers for a URL (the S3 client does not survive fork); each plans the rank's whole
    # pass, step by step, within the limit, so they hold the same files of the shared directory.
    cache = str(tmp_path / "cache")
    ds = ShardDataset(remote, 8, cache_dir=cache, cache_limit="1MiB", **SETTINGS)
    here = ShardDataset(local, 8, **SETTINGS)
    loader = ShardLoader(ds, num_workers=2)
    got = list(loader)
    expected = list(here)
    assert len(got) == len(expected)
    for a, b in zip(expected, got):
        same_batch(a, b)
    names = os.listdir(cache)
    assert not [n for n in names if n.startswith(".tmp-")]
    assert len([n for n in names if n.endswith(".npy")]) <= 15


def test_workers_with_the_default_cache_read_the_local_batches(local, remote, tmp_path):
    """The default limit holds the whole dataset; the workers plan the same pass and share the directory's
    files, so each keeps that limit (together they hold no more than the dataset) and a batch drawing from
    most of the dataset's shards still fits."""
    cache = str(tmp_path / "cache")
    ds = ShardDataset(remote, 32, shuffle=True, seed=3, cache_dir=cache)
    got = list(ShardLoader(ds, num_workers=2))
    expected = list(ShardDataset(local, 32, shuffle=True, seed=3))
    assert len(got) == len(expected)
    for a, b in zip(expected, got):
        same_batch(a, b)
    files = [os.path.join(cache, n) for n in os.listdir(cache) if n.endswith((".npy", ".jsonl"))]
    assert sum(os.path.getsize(f) for f in files) <= sum(shard_bytes(local))


def test_forked_workers_are_refused_with_a_clear_error(remote, tmp_path):
    ds = ShardDataset(remote, 8, cache_dir=str(tmp_path / "cache"))
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=1, multiprocessing_context="fork")
    with pytest.raises(ShardError, match="cannot be read in a process started by fork"):
        list(loader)


def _read_epoch(url: str, cache_dir: str, seed: int, out: str) -> None:
    ds = ShardDataset(url, 8, cache_dir=cache_dir, shuffle=True, seed=seed)
    seen = np.concatenate([indices(b) for b in ds])
    with open(out, "w") as f:
        json.dump({"stats": ds.cache_stats(), "seen": sorted(seen.tolist())}, f)


def test_two_processes_sharing_a_cache_dir_download_each_shard_once(remote, tmp_path):
    context = multiprocessing.get_context("spawn")
    cache, outs = str(tmp_path / "cache"), [str(tmp_path / f"out-{i}.json") for i in range(2)]
    procs = [context.Process(target=_read_epoch, args=(remote, cache, seed, out))
             for seed, out in enumerate(outs)]  # different orders: they meet on some shards
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(180)
        assert proc.exitcode == 0
    results = []
    for out in outs:
        with open(out) as f:
            results.append(json.load(f))
    assert all(r["seen"] == list(range(117)) for r in results)
    assert sum(r["stats"]["downloads"] for r in results) == 15
    assert sum(r["stats"]["adopted"] for r in results) == 15


def test_a_corrupt_object_is_an_error_naming_its_url(s3_server, s3_bucket, local, remote, tmp_path):
    entry = load_manifest(local).shards[4]
    with open(os.path.join(local, entry.path), "rb") as f:
        data = bytearray(f.read())
    data[-1] ^= 0xFF  # same size, one bit off: only the checksum can tell
    s3_server.client().put_object(Bucket=s3_bucket, Key=f"ds/{entry.path}", Body=bytes(data))
    ds = ShardDataset(remote, 8, cache_dir=str(tmp_path / "cache"))  # sizes are right: opens
    with pytest.raises(ShardError, match=f"{remote}/{entry.path}: xxh3_128 differs from the manifest"):
        list(ds)
    assert not [n for n in os.listdir(tmp_path / "cache") if n.startswith(entry.checksum)]


def test_a_missing_object_is_an_error_on_every_rank(s3_server, s3_bucket, local, remote, tmp_path):
    entry = load_manifest(local).shards[6]
    s3_server.client().delete_object(Bucket=s3_bucket, Key=f"ds/{entry.meta_path}")
    for rank in range(2):  # each rank's open lists the shards' folder: every rank refuses, none waits
        missing = f"{remote}/{entry.meta_path}: listed in the manifest but missing"
        with pytest.raises(ShardIntegrityError, match=missing):
            ShardDataset(remote, 8, rank=rank, world_size=2, cache_dir=str(tmp_path / "cache"))


def test_an_object_gone_after_open_is_an_error_naming_its_url(s3_server, s3_bucket, local, remote, tmp_path):
    ds = ShardDataset(remote, 8, cache_dir=str(tmp_path / "cache"))
    entry = load_manifest(local).shards[9]
    s3_server.client().delete_object(Bucket=s3_bucket, Key=f"ds/{entry.path}")
    with pytest.raises(ShardError, match=f"{remote}/{entry.path}: listed in the manifest but missing"):
        list(ds)


def test_cache_arguments_are_checked(local, remote, tmp_path):
    with pytest.raises(ValueError, match="cache_dir and cache_limit are for object-storage URLs"):
        ShardDataset(local, 8, cache_dir=str(tmp_path / "cache"))
    assert ShardDataset(local, 8).cache_stats() is None
    with pytest.raises(ValueError, match="cannot hold the two largest shards"):
        ShardDataset(remote, 8, cache_dir=str(tmp_path / "cache"), cache_limit=max(shard_bytes(local)))
    with pytest.raises(ValueError, match="is not a size"):
        ShardDataset(remote, 8, cache_dir=str(tmp_path / "cache"), cache_limit="big")


def test_the_default_cache_dir_comes_from_the_environment(remote, tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDIO_CACHE_DIR", str(tmp_path / "env-cache"))
    ds = ShardDataset(remote, 16)
    list(ds)
    assert len([n for n in os.listdir(tmp_path / "env-cache") if n.endswith(".npy")]) == 15


def test_a_subset_of_a_remote_dataset_reads_the_same_samples(local, remote, tmp_path):
    from shardio.read.subset import SubsetDataset

    here = SubsetDataset(local, 8, inputs=["input-1.tar"], **SETTINGS)
    with pytest.warns(UserWarning, match="more than once an epoch"):  # 4 shards, two windows are 6
        there = SubsetDataset(remote, 8, inputs=["input-1.tar"], cache_dir=str(tmp_path / "cache"),
                              cache_limit=4 * max(shard_bytes(local)), **SETTINGS)
    for a, b in zip(list(here), list(there), strict=True):
        same_batch(a, b)
    assert there.cache_stats()["peak_bytes"] <= 4 * max(shard_bytes(local))


def test_the_lightning_data_module_passes_the_cache_arguments_to_a_url(local, remote, tmp_path):
    from shardio.train.lightning import ShardDataModule

    module = ShardDataModule(remote, 8, val=local, cache_dir=str(tmp_path / "cache"), cache_limit="1MB")
    module.setup("fit")
    train = module.train_dataset
    assert train.cache_limit == 10**6 and train.cache_dir == str(tmp_path / "cache")
    assert module.val_dataset.cache_stats() is None  # the local one reads in place
    assert len(list(module.train_dataset)) == len(module.train_dataset)


def test_a_snapshot_opened_by_url_reads_through_a_default_cache(local, remote, tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDIO_CACHE_DIR", str(tmp_path / "env-cache"))
    here, there = open_dataset(local), open_dataset(remote)  # as `shardio preview URL` does
    for shard in (0, 7, 14):
        assert np.array_equal(here.pixels(shard), there.pixels(shard))
        assert here.meta(shard).keys == there.meta(shard).keys
    assert there.cache is not None and there.cache.stats["downloads"] == 3


def test_a_new_generation_reuses_the_cached_files_of_the_shards_it_keeps(s3_server, s3_bucket, local,
                                                                         remote, tmp_path):
    from tests.dataset_fixtures import retire_input

    ds = ShardDataset(remote, 8, cache_dir=str(tmp_path / "cache"))
    first = np.concatenate([indices(b) for b in ds])
    assert ds.cache_stats()["downloads"] == 15
    retire_input(local, "input-0.tar")  # a run drops the first input: 40 samples, 5 shards
    upload(s3_server, s3_bucket, local)
    second = np.concatenate([indices(b) for b in ds])  # the next epoch follows the new generation
    assert len(first) == 117 and sorted(second.tolist()) == list(range(40, 117))
    stats = ds.cache_stats()  # the new generation's cache: content addressed, nothing to download
    assert stats["downloads"] == 0 and stats["adopted"] == 10


def test_a_default_window_the_cache_cannot_hold_is_clamped_with_a_warning(local, remote, tmp_path):
    """15 shards, a cache of 6: the default window (all 15 shards here) would not fit; it is clamped to 3,
    two windows of which fit (a batch across a window's end reads both), with a warning saying so; an
    explicit window is kept, with a warning."""
    limit = 6 * max(shard_bytes(local))
    with pytest.warns(UserWarning, match="using shuffle_window=3") as warned:
        ds = ShardDataset(remote, 8, shuffle=True, cache_dir=str(tmp_path / "cache"), cache_limit=limit)
    # It names the dataset's URL, not one of its shard files.
    message = str(warned[0].message)
    assert message.startswith(f"{remote}: cache_limit") and "/shards/" not in message, message
    assert ds.shuffle_window == 3 and ds.state_dict()["shuffle_window"] == 3
    assert_exactly_once(np.concatenate([indices(b) for b in ds]), 117)
    with pytest.warns(UserWarning, match="downloaded more than once"):
        kept = ShardDataset(remote, 8, shuffle=True, shuffle_window=8, cache_dir=str(tmp_path / "cache"),
                            cache_limit=limit)
    assert kept.shuffle_window == 8


def test_a_default_cache_holds_the_whole_dataset_and_reads_the_local_order(s3_server, s3_bucket, tmp_path,
                                                                          layout: Layout, encoding: str):
    """The default cache_limit is the dataset's size (15 shards, the last one shorter; a bucketed dataset's
    every bucket's shards): the whole dataset fits, so the default window (one a bucket) needs no room for
    two windows and is not shrunk: no warning, and the epoch order is the local copy's for the same seed."""
    data = layout.make(str(tmp_path / "local"), encoding)
    remote = upload(s3_server, s3_bucket, data.path)
    here = ShardDataset(data.path, 8, shuffle=True, seed=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        there = ShardDataset(remote, 8, shuffle=True, seed=3, cache_dir=str(tmp_path / "cache"))
    assert there.cache_limit == sum(shard_bytes(data.path))
    assert there.shuffle_window == here.shuffle_window
    for a, b in zip(list(here), list(there), strict=True):
        same_batch(a, b)
        assert a.get("bucket") == b.get("bucket")
        data.check(b)
    # each shard once (15 of a single-shape dataset): the cache kept them all
    assert there.cache_stats()["downloads"] == len(load_manifest(data.path).shards)


@pytest.fixture
def same_tar_twice(s3_server, s3_bucket, tmp_path) -> tuple[str, str]:
    """(local, URL) of a dataset made from one 21-sample tar uploaded as ``a.tar`` and ``b.tar``: the job
    writes each input's shards with the same pixels, and ``.jsonl`` lines that differ only in ``tar``."""
    directory = str(tmp_path / "twice")

    def meta_for(index: int, number: int, name: str) -> dict:
        tar = ("a.tar", "b.tar")[number]
        return {"key": f"s{index % 21:06d}", "tar": tar, "member": f"{index % 21}.jpg", "width": 16,
                "height": 16, "cls": index % 21, "txt": f"caption {index % 21}"}

    write_inputs(directory, (21, 21), meta_for, height=16, width=16, samples_per_shard=8,
                 pixels_for=lambda index: self_identifying_pixels(index % 21, 16, 16))
    shards = load_manifest(directory).shards
    assert [e.checksum for e in shards[:3]] == [e.checksum for e in shards[3:]]  # same pixels, other .jsonl
    return directory, upload(s3_server, s3_bucket, directory, prefix="twice")


# A window of 2 with a cache of 3 shards is below the two windows the cache should hold: the warning
# is expected (tested above); this test is about each twin reading its own metadata.
@pytest.mark.filterwarnings("ignore:.*shuffle_window=2 needs:UserWarning")
@pytest.mark.parametrize("shuffle,limit_shards", [(False, None), (False, 2), (True, 3), (True, 4), (True, None)])
def test_the_same_tar_under_two_names_reads_every_sample_of_both(same_tar_twice, tmp_path, shuffle,
                                                                 limit_shards):
    local, url = same_tar_twice
    settings = {"shuffle": shuffle, "seed": 5, "shuffle_window": 2, "shuffle_block": 4, "drop_last": False}
    limit = None if limit_shards is None else limit_shards * max(shard_bytes(local))
    here = ShardDataset(local, 4, **settings)
    there = ShardDataset(url, 4, cache_dir=str(tmp_path / "cache"), cache_limit=limit, **settings)
    for epoch in range(2):
        here.set_epoch(epoch)
        there.set_epoch(epoch)
        got = list(there)
        for a, b in zip(list(here), got, strict=True):
            same_batch(a, b)
        # Every key twice (once per tar), its pixels its own: nothing missing, nothing read twice.
        keys = [k for b in got for k in b["__key__"]]
        assert sorted(keys) == sorted(f"s{i:06d}" for i in range(21) for _ in range(2))
        seen = np.concatenate([indices(b) for b in got])
        assert sorted(seen.tolist()) == sorted(list(range(21)) * 2)
    if limit is not None:
        assert there.cache_stats()["peak_bytes"] <= limit


def test_encoded_batches_from_the_bucket_are_the_local_ones_copied_out_of_the_cache(s3_server, s3_bucket,
                                                                                   tmp_path):
    """``decode="device"`` on a remote JPEG dataset: the same samples and bytes as the local copy, each batch's
    JPEGs in one fresh buffer of their own, not views of the cached files (which the cache may evict)."""
    local = str(tmp_path / "local-jpeg")
    make_dataset(local, inputs=(20, 12), samples_per_shard=8, height=16, width=16, encoding="jpeg")
    remote = upload(s3_server, s3_bucket, local, "jpeg")
    here = list(ShardDataset(local, 8, decode="device", **SETTINGS))
    there = list(ShardDataset(remote, 8, decode="device", cache_dir=str(tmp_path / "cache"),
                              cache_limit=8 * max(shard_bytes(local)), **SETTINGS))
    assert [b["__key__"] for b in there] == [b["__key__"] for b in here] and len(here) == 4
    for a, b in zip(here, there):
        images = b["image"]
        assert [bytes(j) for j in images.jpegs] == [bytes(j) for j in a["image"].jpegs]
        buffer = images.jpegs[0].base
        assert type(buffer) is np.ndarray and buffer.base is None, "the JPEGs still view a cached file"
        assert all(j.base is buffer for j in images.jpegs)
        assert np.array_equal(images.decode(), a["image"].decode())


def test_a_reader_that_read_a_root_retention_then_collected_reads_the_newest(s3_server, s3_bucket, tmp_path,
                                                                              monkeypatch):
    """On a slow link a reader reads manifest.json, then the run that follows commits, compacts and collects
    the root it read before it fetched the segments: it reads the newest root, not "verify --repair"."""
    directory = str(tmp_path / "ds")
    old_root = compacted_and_collected(directory)
    url = upload(s3_server, s3_bucket, directory, "moving")
    stale_reads(monkeypatch, old_root, lambda n: n == 0)
    index = load_index(url)
    assert index.generation == read_root(directory)["generation"] > old_root["generation"]


# --- bucketed datasets --------------------------------------------------------------------------------------

@pytest.mark.parametrize("encoding", ["raw", "jpeg"])
def test_a_bucketed_dataset_reads_from_a_bucket_at_each_shards_shape(s3_server, s3_bucket, tmp_path, monkeypatch,
                                                                     encoding):
    """Opened by URL, its sizes checked per bucket from the listing, each shard read through the shard cache at
    its own bucket's shape: the same pixels and keys as the local copy."""
    monkeypatch.setenv("SHARDIO_CACHE_DIR", str(tmp_path / "cache"))
    local = make_bucketed_dataset(str(tmp_path / "local"), BUCKETS, (10, 9, 7), encoding=encoding)
    url = upload(s3_server, s3_bucket, local)
    near, far = open_dataset(local), open_dataset(url)
    assert far.is_bucketed and far.buckets == BUCKETS
    assert far.shard_buckets.tolist() == near.shard_buckets.tolist()
    for shard in range(len(far.shards)):
        pixels = np.asarray(far.pixels(shard))
        assert pixels.shape == (far.shards[shard].samples, *far.shard_shape(shard), 3)
        assert (pixels == np.asarray(near.pixels(shard))).all()
        assert far.meta(shard).keys == near.meta(shard).keys


def test_a_remote_shard_whose_header_says_another_bucket_is_refused(s3_server, s3_bucket, tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDIO_CACHE_DIR", str(tmp_path / "cache"))
    local = make_bucketed_dataset(str(tmp_path / "local"), ((8, 12), (12, 8)), (8, 8), inputs=1)
    snapshot = open_dataset(local)
    shard = int(np.flatnonzero(snapshot.shard_buckets == 0)[0])
    entry = snapshot.shards[shard]
    path = os.path.join(local, entry.path)
    data = open(path, "rb").read().replace(b"(8, 8, 12, 3)", b"(8, 12, 8, 3)", 1)
    open(path, "wb").write(data)  # same size; the checksum is checked after the header, so fix it too
    from shardio.store.checksum import file_checksum
    from tests.format.test_index import rewrite_segment

    digest = bytes.fromhex(file_checksum(path, entry.checksum_algorithm))

    def forge(arrays):
        arrays["shard_digest"] = arrays["shard_digest"].copy()
        arrays["shard_digest"][shard, :len(digest)] = np.frombuffer(digest, np.uint8)

    rewrite_segment(local, forge)
    url = upload(s3_server, s3_bucket, local, prefix="forged")
    far = open_dataset(url)
    with pytest.raises(ShardError, match=r"header says \(8, 12, 8\), the shard's images are \(8, 12\)"):
        far.pixels(shard)


def test_a_bucketed_dataset_on_object_storage_reads_as_the_local_copy(s3_server, s3_bucket, tmp_path) -> None:
    """With a cache that evicts: the same buckets, keys and pixels as the local copy, one bucket a batch."""
    data = Layout("buckets").make(str(tmp_path / "local"))
    remote = upload(s3_server, s3_bucket, data.path)
    here = list(ShardDataset(data.path, 4, shuffle=True, seed=4, shuffle_window=3))
    there_ds = ShardDataset(remote, 4, shuffle=True, seed=4, shuffle_window=3, cache_dir=str(tmp_path / "cache"),
                            cache_limit=10**6)
    there = list(there_ds)
    assert len(there) == len(here)
    for a, b in zip(here, there):
        assert a["bucket"] == b["bucket"] and a["__key__"] == b["__key__"]
        assert torch.equal(a["image"], b["image"])
        data.check(b)


def test_the_cache_fits_a_window_of_every_bucket(s3_server, s3_bucket, tmp_path) -> None:
    local = make_bucketed_dataset(str(tmp_path / "local"), buckets=READ_BUCKETS, samples=[23, 41, 9],
                                  samples_per_shard=6)
    remote = upload(s3_server, s3_bucket, local)
    shards = ShardDataset(local, 4).snapshot.shards
    largest = max(e.bytes + e.meta_bytes for e in shards)
    # Room for two windows of 4 shards of one bucket, not of all three: the default window is cut to 1.
    with pytest.warns(UserWarning, match="for each of 3 buckets"):
        ds = ShardDataset(remote, 4, shuffle=True, cache_dir=str(tmp_path / "cache"), cache_limit=8 * largest)
    assert ds.shuffle_window == 8 // (2 * 3)
    keys = Counter(k for batch in ds for k in batch["__key__"])
    assert keys == every_key(ShardDataset(local, 4))
