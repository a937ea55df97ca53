"""Opening the wrong thing, or a corrupted metadata file: a ShardError that names the file and says what
to pass or run instead, never a raw ``UnicodeDecodeError`` / ``NotADirectoryError``."""

from __future__ import annotations

import os
import tarfile

import pytest
from dataset_fixtures import make_dataset

from shardio import ShardDataset, ShardFormatError, open_dataset


@pytest.fixture
def dataset_dir(tmp_path) -> str:
    directory = str(tmp_path / "ds")
    make_dataset(directory, (20,))  # shards of 8: input-0-00000 .. 00002
    return directory


def _flip_to_invalid_utf8(path: str, line: int) -> None:
    """Overwrite one byte of ``line`` (0-based) with 0xFF, keeping the file's size (so only a read finds it)."""
    with open(path, "rb") as f:
        data = bytearray(f.read())
    start = sum(len(x) + 1 for x in bytes(data).split(b"\n")[:line])
    data[start + 3] = 0xFF
    with open(path, "wb") as f:
        f.write(data)


def test_undecodable_metadata_names_the_shard_and_the_line(dataset_dir: str) -> None:
    path = os.path.join(dataset_dir, "shards", "input-0-00001.jsonl")
    _flip_to_invalid_utf8(path, 2)
    with pytest.raises(ShardFormatError, match=r"input-0-00001\.jsonl: line 3 \(sample 2\): not UTF-8.*HINT"):
        open_dataset(dataset_dir).meta(1)
    with pytest.raises(ShardFormatError, match=r"input-0-00001\.jsonl: line 3"):
        for _ in ShardDataset(dataset_dir, 4):
            pass


@pytest.mark.parametrize("row", [b'{"txt": "no key"}', b"[1, 2]", b'{"key": 7}'])
def test_a_metadata_line_that_is_not_a_sample_record_is_named(dataset_dir: str, row: bytes) -> None:
    path = os.path.join(dataset_dir, "shards", "input-0-00001.jsonl")
    with open(path, "rb") as f:
        lines = f.read().split(b"\n")
    lines[4] = row.ljust(len(lines[4]))  # JSON allows the trailing spaces; the size (checked at open) stays
    with open(path, "wb") as f:
        f.write(b"\n".join(lines))
    with pytest.raises(ShardFormatError, match=r"input-0-00001\.jsonl: line 5 \(sample 4\): not a sample record"):
        open_dataset(dataset_dir).meta(1)


def test_the_tar_folder_says_to_preprocess_first(tmp_path) -> None:
    tars = tmp_path / "tars"
    tars.mkdir()
    for name in ("00000.tar", "00001.tar"):
        with tarfile.open(tars / name, "w"):
            pass
    with pytest.raises(ShardFormatError, match=r"manifest\.json: missing; .*2 input tar\(s\).*preprocess run"):
        ShardDataset(str(tars), 4)


def test_a_tar_path_is_not_a_raw_os_error(tmp_path) -> None:
    path = tmp_path / "00000.tar"
    with tarfile.open(path, "w"):
        pass
    with pytest.raises(ShardFormatError, match=r"00000\.tar: is a tar file .*not a dataset directory.*--output DIR"):
        ShardDataset(str(path), 4)
    other = tmp_path / "notes.txt"
    other.write_text("hi")
    with pytest.raises(ShardFormatError, match=r"notes\.txt: is a file, not a dataset directory"):
        open_dataset(str(other))


def test_the_shards_folder_names_the_dataset_directory(dataset_dir: str) -> None:
    shards = os.path.join(dataset_dir, "shards")
    with pytest.raises(ShardFormatError, match=rf"shards/ folder: pass the dataset directory {dataset_dir}$"):
        ShardDataset(shards, 4)
    os.remove(os.path.join(dataset_dir, "manifest.json"))  # a killed first run: no parent manifest either
    with pytest.raises(ShardFormatError, match=r"looks like a shards/ folder: pass the dataset directory"):
        ShardDataset(shards, 4)


def test_a_foreign_directory_says_what_to_pass(tmp_path) -> None:
    (tmp_path / "readme.md").write_text("hi")
    with pytest.raises(ShardFormatError, match=r"not a shardio dataset directory: pass the directory"):
        ShardDataset(str(tmp_path), 4)
