"""shuffle=False: the exact stored order, whole batches, the carried fields, no copy where none is needed."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
from dataset_fixtures import indices, make_dataset
from layout_fixtures import LayoutDataset

from shardio import ShardDataset
from shardio.read.dataset import rank_batches


@pytest.fixture(scope="module")
def dataset_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    directory = str(tmp_path_factory.mktemp("order"))
    make_dataset(directory)
    return directory


@pytest.mark.parametrize("batch_size", [1, 7, 8, 10, 117, 500])
def test_stored_order(dataset_dir: str, batch_size: int) -> None:
    ds = ShardDataset(dataset_dir, batch_size)
    batches = list(ds)
    assert len(batches) == len(ds) == -(-117 // batch_size)
    assert [len(b["__key__"]) for b in batches[:-1]] == [batch_size] * (len(batches) - 1)
    order = np.concatenate([indices(b) for b in batches])
    assert (order == np.arange(117)).all()


def test_batch_fields(dataset_dir: str) -> None:
    batch = next(iter(ShardDataset(dataset_dir, 10)))
    # One schema: no sample has a .json; every dataset's batches carry the sources' size and crop.
    assert set(batch) == {"image", "__key__", "cls", "txt", "json", "original_size", "crop_top_left"}
    assert batch["json"] == [None] * 10
    assert batch["image"].shape == (10, 8, 8, 3) and batch["image"].dtype == torch.uint8
    assert batch["cls"].dtype == torch.int64 and batch["cls"].shape == (10,)
    assert batch["txt"] == [f"caption {i}" for i in range(10)]


def test_only_a_bucketed_datasets_batches_and_state_name_buckets(layout_dataset: LayoutDataset) -> None:
    """A single-shape dataset is one bucket of its shape, and its batches and state say nothing of buckets."""
    data = layout_dataset
    ds = ShardDataset(data.path, 4)
    assert ds.buckets == data.shapes and ds.bucket_sizes == data.sizes and sum(ds.bucket_sizes) == ds.num_samples
    batch = next(iter(ds))
    data.check(batch)
    assert ("bucket" in batch) == ("bucket_positions" in ds.state_dict()) == data.bucketed


def test_json_field(tmp_path) -> None:
    make_dataset(str(tmp_path), (5,), txt=False, json_field=True)
    batch = next(iter(ShardDataset(str(tmp_path), 5)))
    assert batch["txt"] == [None] * 5
    assert batch["json"] == [{"i": i} for i in range(5)]


def test_one_shard_batch_is_a_view(dataset_dir: str) -> None:
    """A batch inside one shard is the memory map itself; one spanning shards is one fresh buffer."""
    ds = ShardDataset(dataset_dir, 4)
    first, second, third = (b["image"] for b, _ in zip(ds, range(3)))
    pixels = ds.shard(0)[0]
    assert first.data_ptr() == pixels.ctypes.data and second.data_ptr() == pixels.ctypes.data + 4 * 8 * 8 * 3
    spanning = list(ShardDataset(dataset_dir, 6))[1]  # samples 6..11: shards 0 and 1
    assert (indices(spanning) == np.arange(6, 12)).all()
    # Writing to a batch never reaches the file (copy-on-write map).
    first.zero_()
    assert (indices(next(iter(ShardDataset(dataset_dir, 4)))) == np.arange(4)).all()
    del third


@pytest.mark.parametrize("samples", [1, 5, 16, 117])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("batch_size", [1, 4, 8])
def test_rank_batches_partition(samples: int, world_size: int, batch_size: int) -> None:
    """The arithmetic alone, over many sizes: equal counts, disjoint cover, at most W-1 repeats."""
    for drop_last in (False, True):
        plans = [rank_batches(samples, batch_size, r, world_size, drop_last) for r in range(world_size)]
        assert len({len(p) for p in plans}) == 1
        sizes = [len(b) for p in plans for b in p]
        assert all(1 <= s <= batch_size for s in sizes)
        seen = np.array([i for p in plans for b in p for i in b], dtype=np.int64)
        full = samples - samples % (batch_size * world_size)
        if drop_last:
            assert (np.sort(seen) == np.arange(full)).all()
        else:
            unique = np.unique(seen)
            assert (unique == np.arange(samples)).all()
            assert len(seen) - samples == max(0, world_size - (samples - full)) * (samples != full)
            last = [len(p[-1]) for p in plans]
            assert max(last) - min(last) <= 1


def test_imports_with_numpy_and_torch_only() -> None:
    code = ("import sys, shardio; bad = [m for m in ('PIL', 'ray', 'yaml', 'webdataset') "
            "if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_every_batch_has_the_same_keys_whatever_its_shards_carry(tmp_path) -> None:
    """Input 0 has captions and labels, input 1 neither, input 2 json only: one schema for all batches,
    a missing label -1 and a missing caption or json None, also in batches spanning both kinds."""
    mixed = str(tmp_path / "mixed")
    _mixed_dataset(mixed)
    ds = ShardDataset(mixed, 5, shuffle=True)
    assert ds.fields == ("cls", "txt", "json")
    batches = list(ds)
    schema = {"image", "__key__", "cls", "txt", "json", "original_size", "crop_top_left"}
    assert {frozenset(b) for b in batches} == {frozenset(schema)}
    for batch in batches:
        found = np.array([int(k[1:]) for k in batch["__key__"]])
        labelled = found < 10
        assert (batch["cls"].numpy() == np.where(labelled, found, -1)).all()
        assert batch["txt"] == [f"caption {i}" if i < 10 else None for i in found]
        assert batch["json"] == [{"i": int(i)} if i >= 20 else None for i in found]


def _mixed_dataset(directory: str) -> None:
    from shardio.format import InputEntry, Manifest
    from shardio.write.shard_writer import InputShardWriter, write_manifest

    manifest = Manifest(shape=(8, 8, 3), config={"height": 8, "width": 8}, versions={"shardio": "test"})
    for number, (first, count) in enumerate([(0, 10), (10, 10), (20, 9)]):
        name = f"input-{number}.tar"
        writer = InputShardWriter(directory, f"input-{number}", 8, 8, 8)
        for i in range(first, first + count):
            meta = {"key": f"s{i:06d}", "tar": name, "member": f"{i}.jpg", "width": 8, "height": 8,
                    "cls": i if i < 10 else None, "txt": f"caption {i}" if i < 10 else None,
                    "json": {"i": i} if i >= 20 else None}
            writer.add(np.full((8, 8, 3), i, dtype=np.uint8), meta, name)
        entries = writer.close(name)
        manifest.shards.extend(entries)
        manifest.inputs[name] = InputEntry(size=count, mtime_ns=0, samples=count, failed=0,
                                           shards=[e.path for e in entries])
    write_manifest(directory, manifest)
