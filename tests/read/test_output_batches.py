"""Model outputs read back (spec, "Model outputs"): every batch holds each output under its name, a tensor
[B, *shape] of its dtype, the rows of exactly the batch's samples (whatever the shuffle, resume, rank, subset,
DataLoader worker or bucket); ``ds.sample(i)``; ``DeviceLoader`` moves them as they are; the shard checker
names a damaged output file; ``shardio info`` lists them; a mix needs the same outputs."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from shardio import DeviceLoader, ShardDataset
from shardio.errors import DatasetIncompatibleError
from shardio.format.manifests import load_index
from shardio.format.model_outputs import output_path
from shardio.format.shard_check import shard_problems
from shardio.read.mixing import MixedDataset
from shardio.read.subset import SubsetDataset
from shardio.store.root import open_root
from shardio.tools.info import dataset_info, format_info
from shardio.train.loader import ShardLoader
from tests.output_datasets import expected, make_output_dataset, output_specs

NAMES = ("latent", "embed", "bits")
DTYPES = {"latent": torch.float16, "embed": torch.int32, "bits": torch.bfloat16}


@pytest.fixture(params=[False, True], ids=["single", "buckets"])
def bucketed(request) -> bool:
    return request.param


@pytest.fixture
def dataset(tmp_path, bucketed) -> str:
    directory = str(tmp_path / "ds")
    make_output_dataset(directory, bucketed=bucketed)
    return directory


def check_batch(batch: dict, bucketed: bool) -> list[int]:
    """The batch's sample indices, having checked each output's rows against them."""
    indices = [int(key[1:]) for key in batch["__key__"]]
    for name in NAMES:
        values = batch[name]
        assert isinstance(values, torch.Tensor) and values.dtype == DTYPES[name], name
        assert values.shape[0] == len(indices)
        for row, index in zip(values, indices):
            assert torch.equal(row.cpu(), expected(name, index, bucketed)), (name, index)
    return indices


def test_every_batch_holds_its_samples_outputs(dataset, bucketed) -> None:
    ds = ShardDataset(dataset, batch_size=4, shuffle=True, seed=3)
    seen = [i for batch in ds for i in check_batch(batch, bucketed)]
    assert sorted(seen) == list(range(12))
    assert [o.name for o in ds.outputs] == list(NAMES) and ds.outputs == output_specs(bucketed)


def test_one_slice_and_many_slices_give_the_same_rows(dataset, bucketed) -> None:
    sequential = ShardDataset(dataset, batch_size=1, shuffle=False)  # a batch inside one shard: a view of the map
    assert sorted(i for batch in sequential for i in check_batch(batch, bucketed)) == list(range(12))


def test_resume_and_ranks_keep_outputs_with_their_samples(dataset, bucketed) -> None:
    ds = ShardDataset(dataset, batch_size=2, shuffle=True, seed=1)
    it = iter(ds)
    next(it)
    state = ds.state_dict()
    rest = [i for batch in it for i in check_batch(batch, bucketed)]
    resumed = ShardDataset(dataset, batch_size=2, shuffle=True, seed=1)
    resumed.load_state_dict(state)
    assert [i for batch in resumed for i in check_batch(batch, bucketed)] == rest
    for rank in range(2):
        for batch in ShardDataset(dataset, batch_size=2, shuffle=True, seed=1, rank=rank, world_size=2):
            check_batch(batch, bucketed)


def test_a_subset_and_a_dataloader_worker_keep_outputs_with_their_samples(dataset, bucketed) -> None:
    subset = SubsetDataset(dataset, batch_size=3, keys=[f"s{i}" for i in (1, 2, 5, 8, 11)], shuffle=False)
    assert sorted(i for batch in subset for i in check_batch(batch, bucketed)) == [1, 2, 5, 8, 11]
    loader = ShardLoader(ShardDataset(dataset, batch_size=4, shuffle=True), num_workers=1)
    assert sorted(i for batch in loader for i in check_batch(batch, bucketed)) == list(range(12))


def test_sample_holds_its_outputs(dataset, bucketed) -> None:
    ds = ShardDataset(dataset, batch_size=4)
    for position in (0, 5, -1):
        sample = ds.sample(position)
        index = int(sample["__key__"][1:])
        for name in NAMES:
            assert torch.equal(sample[name], expected(name, index, bucketed))


def test_device_loader_moves_outputs_without_normalising_them(dataset, bucketed) -> None:
    loader = DeviceLoader(ShardDataset(dataset, batch_size=4, shuffle=True), device="cpu")
    for batch in loader:
        check_batch(batch, bucketed)
        assert batch["image"].dtype == torch.float32  # the picture normalised, the outputs as stored


def test_a_dataset_without_outputs_keeps_its_batches(tmp_path, bucketed) -> None:
    directory = str(tmp_path / "plain")
    make_output_dataset(directory, bucketed=bucketed, with_outputs=False)
    ds = ShardDataset(directory, batch_size=4)
    assert ds.outputs == ()
    assert not set(NAMES) & set(next(iter(ds))) and not set(NAMES) & set(ds.sample(0))


def test_a_damaged_output_file_is_named(dataset) -> None:
    root = open_root(dataset)
    index = load_index(dataset)
    entry = index.shards[1]
    latent = os.path.join(dataset, output_path(entry.path, "latent"))
    with open(latent, "r+b") as f:  # same size: only its checksum can tell
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0xFF]))
    assert shard_problems(root, index) == []
    problems = shard_problems(root, index, checksums=True)
    assert [(e.path, p.split(":")[0]) for e, p in problems] == [(entry.path, latent)]
    embed = os.path.join(dataset, output_path(index.shards[0].path, "embed"))
    with open(embed, "r+b") as f:
        f.truncate(os.path.getsize(embed) - 4)
    problems = shard_problems(root, index)
    assert len(problems) == 1 and embed in problems[0][1] and "bytes" in problems[0][1]
    os.remove(embed)
    assert "missing" in shard_problems(root, index)[0][1]
    with pytest.raises(Exception, match="embed.npy"):
        list(ShardDataset(dataset, batch_size=12, shuffle=False))


def test_info_lists_the_outputs(dataset) -> None:
    info = dataset_info(dataset)
    assert [o["name"] for o in info["outputs"]] == list(NAMES)
    text = format_info(info)
    assert "outputs      3: latent, embed, bits" in text
    assert "bits: text -> bfloat16 [2]" in text and "toy:vae weights xxh3_128:ab" in text


def test_a_mix_needs_the_same_outputs(tmp_path, bucketed) -> None:
    make_output_dataset(str(tmp_path / "a"), bucketed=bucketed)
    make_output_dataset(str(tmp_path / "b"), inputs=(4,), bucketed=bucketed)
    make_output_dataset(str(tmp_path / "plain"), bucketed=bucketed, with_outputs=False)
    same = MixedDataset([ShardDataset(str(tmp_path / n), batch_size=2) for n in "ab"], [1, 1],
                        batches_per_epoch=6)
    for batch in same:
        assert set(NAMES) <= set(batch)
    with pytest.raises(DatasetIncompatibleError, match="model outputs"):
        MixedDataset([ShardDataset(str(tmp_path / "a"), batch_size=2),
                      ShardDataset(str(tmp_path / "plain"), batch_size=2)], [1, 1])


def test_a_bfloat16_output_holds_the_bits_written(dataset, bucketed) -> None:
    batch = next(iter(ShardDataset(dataset, batch_size=12, shuffle=False)))
    bits = batch["bits"].view(torch.int16).numpy().view(np.uint16)
    indices = [int(key[1:]) for key in batch["__key__"]]
    assert (bits[:, 0] == np.array([expected("bits", i).view(torch.int16)[0].item() for i in indices],
                                   dtype=np.int64).astype(np.uint16)).all()


def test_a_dataset_without_pixels_gives_its_outputs_alone(tmp_path, bucketed) -> None:
    directory = str(tmp_path / "none")
    manifest = make_output_dataset(directory, bucketed=bucketed, encoding="none")
    assert all(os.path.getsize(os.path.join(directory, e.path)) == 128 for e in manifest.shards)
    ds = ShardDataset(directory, batch_size=4, shuffle=True)
    seen = []
    for batch in ds:
        assert "image" not in batch
        seen += check_batch(batch, bucketed)
    assert sorted(seen) == list(range(12))
    assert "image" not in ds.sample(0) and torch.equal(ds.sample(0)["embed"], expected("embed", 0))
    for batch in DeviceLoader(ShardDataset(directory, batch_size=4), device="cpu"):
        assert "image" not in batch
        check_batch(batch, bucketed)
    root = open_root(directory)
    assert shard_problems(root, load_index(directory), checksums=True) == []
    assert "encoding     none: no pixels kept" in format_info(dataset_info(directory))
    make_output_dataset(str(tmp_path / "raw"), bucketed=bucketed)
    with pytest.raises(DatasetIncompatibleError, match="without image"):
        MixedDataset([ShardDataset(directory, batch_size=2), ShardDataset(str(tmp_path / "raw"), batch_size=2)],
                     [1, 1])


def test_a_dataset_without_pixels_has_no_preview(tmp_path) -> None:
    from shardio.errors import UsageError
    from shardio.tools.preview import write_preview

    directory = str(tmp_path / "none")
    make_output_dataset(directory, encoding="none")
    with pytest.raises(UsageError, match="keeps no pixels"):
        write_preview(directory, str(tmp_path / "p.png"))
    assert not os.path.exists(tmp_path / "p.png")
