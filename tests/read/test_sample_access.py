"""One sample by its stored index (``ds.sample(i)``) and a key's index (``ds.find``), on raw and JPEG
datasets, over a subset too; the index work per call is a binary search, not a walk of the shards."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch

from shardio import ShardDataset
from shardio.read import sample_access
from shardio.read.subset import SubsetDataset
from tests.dataset_fixtures import AWKWARD_INPUTS, make_dataset, pixel_indices, write_inputs
from tests.layout_fixtures import LayoutDataset
from tests.legacy_format import as_legacy

TOTAL = sum(AWKWARD_INPUTS)  # 117 samples of three inputs in shards of 8


@pytest.fixture
def dataset(tmp_path, encoding) -> str:
    make_dataset(str(tmp_path / "ds"), json_field=True, encoding=encoding)
    return str(tmp_path / "ds")


def index_of(sample) -> int:
    return int(pixel_indices(torch.from_numpy(sample["image"][None]))[0])


def test_every_sample_by_its_index_in_stored_order(dataset):
    ds = ShardDataset(dataset, batch_size=16, shuffle=True)
    assert ds.num_samples == TOTAL and len(ds) == -(-TOTAL // 16)
    for i in [0, 7, 8, 39, 40, 84, 85, TOTAL - 1, *range(0, TOTAL, 5)]:
        sample = ds.sample(i)
        assert index_of(sample) == i == sample["cls"] == sample["index"]
        assert sample["__key__"] == f"s{i:06d}" and sample["txt"] == f"caption {i}" and sample["json"] == {"i": i}
        assert sample["image"].dtype == np.uint8 and sample["image"].shape == (8, 8, 3)
    assert ds.sample(-1)["index"] == TOTAL - 1
    for bad in (TOTAL, -TOTAL - 1):
        with pytest.raises(IndexError, match=f"sample {bad} of {TOTAL}"):
            ds.sample(bad)


def test_sample_access_is_at_the_samples_own_shape(layout_dataset: LayoutDataset):
    """A bucketed dataset's sample is at its bucket's shape; a single-shape dataset's all at its one."""
    ds = ShardDataset(layout_dataset.path, 4)
    shapes = Counter(tuple(ds.sample(i)["image"].shape[:2]) for i in range(ds.num_samples))
    assert shapes == layout_dataset.shape_counts()


def test_find_gives_the_index_of_a_key_and_says_which_inputs_share_one(dataset, tmp_path):
    ds = ShardDataset(dataset, batch_size=16)
    assert [ds.find(f"s{i:06d}") for i in (0, 50, 116)] == [0, 50, 116]
    assert ds.find("s000050", input="input-1.tar") == 50
    assert ds.sample(ds.find("s000090"))["cls"] == 90
    with pytest.raises(KeyError, match="no key 's999999'"):
        ds.find("s999999")
    with pytest.raises(KeyError, match="no key 's000050' in input 'input-0.tar'"):
        ds.find("s000050", input="input-0.tar")
    # Keys are unique per input, not per dataset: a key two inputs hold (k0: samples 0 and 3) needs input=.
    repeated = str(tmp_path / "repeated")
    def meta(i, n, name):
        key = f"k{i}" if n == 0 else "k0" if i == 3 else f"x{i}"
        return {"key": key, "tar": name, "member": "m", "width": 8, "height": 8, "cls": i, "txt": None, "json": None}

    write_inputs(repeated, (3, 4), meta, height=8, width=8)
    other = ShardDataset(repeated, batch_size=2)
    with pytest.raises(KeyError, match=r"key 'k0' is in several inputs \(input-0.tar, input-1.tar\): pass input="):
        other.find("k0")
    assert other.find("k0", input="input-1.tar") == 3 and other.find("k2") == 2 and other.find("x5") == 5


def test_a_subset_is_indexed_over_its_own_samples(dataset):
    ds = SubsetDataset(dataset, batch_size=4, inputs=["input-1.tar"])
    assert ds.num_samples == AWKWARD_INPUTS[1]
    assert [index_of(ds.sample(i)) for i in range(ds.num_samples)] == list(range(40, 85))


def test_indexing_a_dataset_points_to_sample_and_find(dataset):
    """A ShardDataset iterates batches and ``len`` counts them, so ``ds[i]`` is no sample: a TypeError
    that names ``ds.sample(i)`` and ``ds.find(key)``, for a subset and a mix too."""
    from shardio.read.mixing import MixedDataset

    ds = ShardDataset(dataset, batch_size=16)
    subset = SubsetDataset(dataset, batch_size=16, inputs=["input-1.tar"])
    for source in (ds, subset):
        with pytest.raises(TypeError, match=r"ds\.sample\(i\).*ds\.find\(key\).*len\(ds\) = 8 batches"
                           if source is ds else r"ds\.sample\(i\)"):
            source[0]
    mixed = MixedDataset([ds, ShardDataset(dataset, batch_size=16)], [1, 1])
    with pytest.raises(TypeError, match=r"datasets\[k\]\.sample\(i\)"):
        mixed[0]


def test_a_sample_opens_its_own_shard_and_no_other(dataset, monkeypatch):
    """No walk over shards or samples per call: only the shard that holds the sample is asked for (its
    entry, map and metadata), found by a search over the counts summed once at open."""
    ds = ShardDataset(dataset, batch_size=16)
    table = type(ds.snapshot.shards)
    asked = []
    real = table.__getitem__
    monkeypatch.setattr(table, "__getitem__", lambda self, i: asked.append(i) or real(self, i))
    monkeypatch.setattr(np, "cumsum", lambda *a, **k: pytest.fail("counts summed per call"))
    assert ds.sample(100)["index"] == 100
    # Inputs of 40, 45, 32 in shards of 8: shards 0-4, 5-10 (the last of 5), 11-14; sample 100 is the
    # 16th of the third input: shard 12, row 7.
    assert set(asked) == {12} and sample_access.locate(ds.snapshot.offsets, 100) == (12, 7)


def test_a_sample_and_its_batch_carry_the_sources_size_and_crop(tmp_path, encoding):
    # SDXL's conditioning as the job writes it: each line's upright source size and what its centre crop cut.
    def meta(i, n, name):
        return {"key": f"s{i:06d}", "tar": name, "member": f"{i}.jpg", "width": 300 + i,
                "height": 200 + 2 * i, "crop": [i % 5, 3 * i], "cls": i, "txt": None, "json": None}

    directory = str(tmp_path / "sized")
    write_inputs(directory, (13, 6), meta, height=8, width=8, encoding=encoding,
                 config={"height": 8, "width": 8, "mode": "center_crop", "encoding": encoding, "quality": 90,
                         "subsampling": "4:4:4"})
    ds = ShardDataset(directory, batch_size=4, shuffle=True)
    for i in (0, 7, 8, 12, 13, 18):
        sample = ds.sample(i)
        assert sample["original_size"].dtype == sample["crop_top_left"].dtype == np.int64
        assert sample["original_size"].tolist() == [200 + 2 * i, 300 + i]
        assert sample["crop_top_left"].tolist() == [i % 5, 3 * i]
    for batch in ds:
        index = pixel_indices(batch["image"])
        assert batch["original_size"].dtype == batch["crop_top_left"].dtype == torch.int64
        assert batch["original_size"].tolist() == [[200 + 2 * i, 300 + i] for i in index.tolist()]
        assert batch["crop_top_left"].tolist() == [[i % 5, 3 * i] for i in index.tolist()]


@pytest.mark.parametrize("mode, crop", [(None, [-1, -1]), ("center_crop", [-1, -1]), ("pad", [0, 0]),
                                        ("stretch", [0, 0])])
def test_lines_written_without_a_crop_read_as_unknown_or_as_uncut(tmp_path, mode, crop):
    # An older dataset (format 2 layout, lines without ``crop``): its crop is unknown, -1, unless its mode
    # cuts nothing (pad, stretch: (0, 0)); a line without width/height gives -1 too.
    def meta(i, n, name):
        line = {"key": f"s{i:06d}", "tar": name, "member": f"{i}.jpg", "cls": i, "txt": None, "json": None}
        return line if i == 5 else {**line, "width": 40 + i, "height": 30}

    directory = str(tmp_path / "old")
    config = {"height": 8, "width": 8, **({"mode": mode} if mode else {})}
    write_inputs(directory, (7, 4), meta, height=8, width=8, config=config)
    as_legacy(directory)
    ds = ShardDataset(directory, batch_size=4)
    expected_size = {i: [-1, -1] if i == 5 else [30, 40 + i] for i in range(11)}
    assert ds.sample(5)["original_size"].tolist() == [-1, -1]
    assert ds.sample(6)["original_size"].tolist() == [30, 46]
    for batch in ds:
        index = pixel_indices(batch["image"]).tolist()
        assert batch["original_size"].tolist() == [expected_size[i] for i in index]
        assert batch["crop_top_left"].tolist() == [crop] * len(index)
        assert ds.sample(index[0])["crop_top_left"].tolist() == crop
