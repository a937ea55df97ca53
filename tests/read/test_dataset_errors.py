"""Bad input fails when the dataset is opened, with a ShardError naming the file and what to do."""

from __future__ import annotations

import json
import os

import pytest
from dataset_fixtures import make_dataset

from shardio import ShardDataset, ShardError, ShardFormatError, ShardIntegrityError


@pytest.fixture
def dataset_dir(tmp_path) -> str:
    make_dataset(str(tmp_path), (20,))
    return str(tmp_path)


def shard_file(directory: str, index: int = 1, suffix: str = ".npy") -> str:
    return os.path.join(directory, "shards", f"input-0-{index:05d}{suffix}")


def test_missing_shard(dataset_dir: str) -> None:
    os.remove(shard_file(dataset_dir))
    with pytest.raises(ShardIntegrityError, match=r"input-0-00001\.npy.*missing.*HINT"):
        ShardDataset(dataset_dir, 4)


def test_missing_metadata(dataset_dir: str) -> None:
    os.remove(shard_file(dataset_dir, suffix=".jsonl"))
    with pytest.raises(ShardIntegrityError, match=r"input-0-00001\.jsonl.*missing"):
        ShardDataset(dataset_dir, 4)


def test_truncated_shard(dataset_dir: str) -> None:
    path = shard_file(dataset_dir)
    os.truncate(path, os.path.getsize(path) - 1)
    with pytest.raises(ShardIntegrityError, match=r"input-0-00001\.npy.*truncated"):
        ShardDataset(dataset_dir, 4)


def test_corrupt_header(dataset_dir: str) -> None:
    with open(shard_file(dataset_dir), "r+b") as f:
        f.write(b"garbage!")
    with pytest.raises(ShardFormatError, match=r"input-0-00001\.npy.*not a shardio shard"):
        ShardDataset(dataset_dir, 4)


def test_corrupt_pixels_found_by_verify(dataset_dir: str) -> None:
    path = shard_file(dataset_dir)
    with open(path, "r+b") as f:
        f.seek(500)
        f.write(b"\xff\x00\xff")
    ShardDataset(dataset_dir, 4)  # same size, same header: only a full read can tell
    with pytest.raises(ShardIntegrityError, match=r"input-0-00001\.npy: xxh3_128 differs from the manifest"):
        ShardDataset(dataset_dir, 4, verify=True)


def test_other_format_version(dataset_dir: str) -> None:
    path = os.path.join(dataset_dir, "manifest.json")
    with open(path) as f:
        doc = json.load(f)
    doc["format_version"] = 7
    with open(path, "w") as f:
        json.dump(doc, f)
    with pytest.raises(ShardFormatError, match=r"manifest\.json.*format_version 7.*reads versions 1, 2, 3, 4, 5, 6"):
        ShardDataset(dataset_dir, 4)


def test_a_single_shape_root_claiming_version_4_is_refused(dataset_dir: str) -> None:
    """Version 4 is a bucketed dataset's: a root that says 4 without buckets is forged, and said so."""
    path = os.path.join(dataset_dir, "manifest.json")
    with open(path) as f:
        doc = json.load(f)
    doc["format_version"] = 4
    with open(path, "w") as f:
        json.dump(doc, f)
    with pytest.raises(ShardFormatError, match=r"manifest\.json: format_version 4 with a config whose mode is not "
                                               r"'bucket': edited or forged"):
        ShardDataset(dataset_dir, 4)


def test_empty_directory(tmp_path) -> None:
    with pytest.raises(ShardFormatError, match=r"manifest\.json.*directory is empty"):
        ShardDataset(str(tmp_path), 4)


def test_missing_directory(tmp_path) -> None:
    with pytest.raises(ShardFormatError, match="no such dataset directory"):
        ShardDataset(str(tmp_path / "nope"), 4)


def test_shards_without_manifest(dataset_dir: str) -> None:
    os.remove(os.path.join(dataset_dir, "manifest.json"))
    with pytest.raises(ShardFormatError, match=r"manifest\.json.*still writing or was killed"):
        ShardDataset(dataset_dir, 4)


def test_errors_are_shard_errors() -> None:
    assert issubclass(ShardFormatError, ShardError) and issubclass(ShardIntegrityError, ShardError)


@pytest.mark.parametrize("kwargs,message", [
    ({"batch_size": 0}, "batch_size"),
    ({"batch_size": 2.5}, "batch_size"),
    ({"batch_size": 4, "shuffle_window": 0}, "shuffle_window"),
    ({"batch_size": 4, "shuffle_block": -1}, "shuffle_block"),
    ({"batch_size": 4, "rank": 2, "world_size": 2}, "rank"),
    ({"batch_size": 4, "rank": 1}, "rank"),
    ({"batch_size": 4, "world_size": 0}, "world_size"),
    ({"batch_size": 8, "world_size": 3, "drop_last": True}, "no full batch"),
])
def test_bad_arguments(dataset_dir: str, kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ShardDataset(dataset_dir, **kwargs)


def test_loader_refuses_what_would_break_order(dataset_dir: str) -> None:
    from shardio import ShardLoader

    ds = ShardDataset(dataset_dir, 4)
    for kwargs in ({"persistent_workers": True, "num_workers": 1}, {"in_order": False}, {"batch_size": 4}):
        with pytest.raises(ValueError):
            ShardLoader(ds, **kwargs)


def test_captions_with_unicode_line_separators_survive(tmp_path):
    """U+2028 / U+2029 / U+0085 are common in web captions and are not line breaks in JSON lines."""
    import numpy as np

    from shardio import open_dataset
    from shardio.format import Manifest
    from shardio.write.shard_writer import InputShardWriter, write_manifest

    writer = InputShardWriter(str(tmp_path), "caps", 4, 4, 10)
    captions = ["a\u2028b", "c\u2029d", "e\u0085f"]
    for i, caption in enumerate(captions):
        writer.add(np.full((4, 4, 3), i, np.uint8), {"key": str(i), "txt": caption}, "in.tar")
    write_manifest(str(tmp_path), Manifest(shape=(4, 4, 3), config={}, versions={}, shards=writer.close("in.tar")))
    assert open_dataset(str(tmp_path)).meta(0).txt == captions


@pytest.mark.parametrize("num_workers", [0, 1])
@pytest.mark.parametrize("drop_last", [True, False])
def test_a_dataloader_that_batches_the_batches_again_fails_at_once_naming_batch_size_none(
        dataset_dir: str, num_workers: int, drop_last: bool) -> None:
    """``DataLoader(ds, batch_size=2)``, the idiom for per-sample datasets, once yielded batches of batches
    (``image`` [2, 4, H, W, 3]) or, with a partial last batch, failed inside torch.stack."""
    from torch.utils.data import DataLoader

    ds = ShardDataset(dataset_dir, 4, drop_last=False)  # 20 samples: 5 batches, so 2 + 2 + 1
    loader = DataLoader(ds, batch_size=2, num_workers=num_workers, drop_last=drop_last)
    with pytest.raises(ValueError, match=r"batches them again .* pass batch_size=None to the DataLoader"):
        next(iter(loader))
    # batch_size=None is the dataset's own batches, unchanged.
    batches = list(DataLoader(ds, batch_size=None, num_workers=num_workers))
    assert [len(b["image"]) for b in batches if num_workers == 0] in ([4, 4, 4, 4, 4], [])
    assert sum(len(b["image"]) for b in batches) == 20
