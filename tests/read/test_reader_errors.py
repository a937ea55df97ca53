"""Opening the wrong thing, or a corrupted metadata file: a ShardError that names the file and says what
to pass or run instead, never a raw ``UnicodeDecodeError`` / ``NotADirectoryError``."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile

import pytest
from dataset_fixtures import make_dataset, write_inputs

from shardio import ShardDataset, ShardFormatError, open_dataset
from shardio.format.manifests import load_manifest
from shardio.read.shard_meta import ShardMeta

from shardio.store.base import LOCK_NAME
from shardio.store.local import lock


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
        open_dataset(dataset_dir).meta(1).keys
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
        open_dataset(dataset_dir).meta(1).keys


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


@pytest.mark.parametrize("written", ["nothing yet", "shards"])
def test_a_dataset_whose_first_run_is_writing_names_the_run(tmp_path, written) -> None:
    directory = str(tmp_path / "ds")
    os.makedirs(directory)
    if written == "shards":
        os.makedirs(os.path.join(directory, "shards"))
    with lock(directory):  # as `preprocess run` holds it from before Ray starts to its last commit
        with pytest.raises(ShardFormatError) as caught:
            open_dataset(directory)
        message = str(caught.value)
        assert f"a run is writing it (pid {os.getpid()} on {os.uname().nodename})" in message, message
        assert "run `preprocess run" not in message
    with pytest.raises(ShardFormatError, match="the directory is empty" if written == "nothing yet" else "killed"):
        open_dataset(directory)  # released: nobody is writing


def test_a_killed_first_run_is_not_said_to_be_writing(tmp_path) -> None:
    directory = str(tmp_path / "ds")
    os.makedirs(directory)
    # A holder SIGKILLed mid-run: its note stays in the lock file, its pid is gone.
    code = ("import os, signal; from shardio.store.local import lock; held = lock(%r); held.__enter__(); "
            "os.kill(os.getpid(), signal.SIGKILL)" % directory)
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == -9
    assert open(os.path.join(directory, LOCK_NAME)).read().startswith("pid ")
    with pytest.raises(ShardFormatError, match="the directory is empty"):
        open_dataset(directory)


@pytest.mark.parametrize("expires_in", [60.0, -1.0])
def test_a_lease_names_its_holder_until_it_expires(tmp_path, expires_in) -> None:
    """Object storage's lock is a lease (``shardio.store.lease``: JSON with ``expires``); read the same way."""
    import json
    import time

    directory = str(tmp_path / "ds")
    os.makedirs(directory)
    lease = {"holder": "pid 4242 on other-host", "host": "other-host", "pid": 4242, "expires": time.time() + expires_in}
    with open(os.path.join(directory, LOCK_NAME), "w") as f:
        json.dump(lease, f)
    expected = r"a run is writing it \(pid 4242 on other-host\)" if expires_in > 0 else "the directory is empty"
    with pytest.raises(ShardFormatError, match=expected):
        open_dataset(directory)


# --- hostile values: a ShardFormatError naming the file (and line), never a bare OverflowError / RecursionError ---

_DEEP = b"[" * 200_000 + b"]" * 200_000


def _edit_root(directory: str, edit) -> None:
    path = os.path.join(directory, "manifest.json")
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(edit(data))


@pytest.mark.parametrize("edit, words", [
    (lambda data: data.replace(b'"generation": 1,', b'"generation": 1e400,'), r'"generation" is .inf.'),
    (lambda data: data.replace(b'"generation": 1,', b'"generation": 1.7,'), r'"generation" is .1\.7.'),
    (lambda data: data.replace(b'"shape": [', b'"shape": [1e400, '), r"shape \[inf, .* is not \[H, W, 3\]"),
    (lambda data: _DEEP, r"JSON nested too deeply"),
])
def test_a_hostile_root_names_the_file(dataset_dir: str, edit, words) -> None:
    _edit_root(dataset_dir, edit)
    manifest = os.path.join(dataset_dir, "manifest.json")
    with pytest.raises(ShardFormatError, match=rf"{manifest}: {words}"):
        open_dataset(dataset_dir)
    with pytest.raises(ShardFormatError, match=rf"{manifest}: {words}"):
        load_manifest(dataset_dir)


def test_a_hostile_root_committed_while_reading_names_the_file(dataset_dir: str) -> None:
    """A new epoch looks for the newest generation: a forged one is named, not an OverflowError."""
    dataset = ShardDataset(dataset_dir, 4)
    _edit_root(dataset_dir, lambda data: data.replace(b'"generation": 1,', b'"generation": 1e400,'))
    with pytest.raises(ShardFormatError, match=r"manifest\.json: \"generation\" is 'inf'"):
        next(iter(dataset))


def _dataset_with_labels(directory: str, labels: list) -> None:
    def meta_for(index: int, number: int, name: str) -> dict:
        return {"key": f"s{index:06d}", "tar": name, "member": f"{index}.jpg", "width": 8, "height": 8,
                "cls": labels[index], "txt": None, "json": None}
    write_inputs(directory, (len(labels),), meta_for, height=8, width=8)


@pytest.mark.parametrize("label", ["x", [1, 2], 10**30, 1.7, True])
def test_a_label_that_is_not_an_int64_names_the_shard_and_the_line(tmp_path, label) -> None:
    directory = str(tmp_path / "labels")
    _dataset_with_labels(directory, [0, 1, 2, label, 4])
    with pytest.raises(ShardFormatError, match=r"input-0-00000\.jsonl: line 4 \(sample 3\): cls .* is not an "
                                               r"integer label"):
        for _ in ShardDataset(directory, 5):
            pass
    assert list(open_dataset(directory).meta(0).rows(0, 3)) == [  # the rows before it read normally
        (f"s{i:06d}", None, i, None, (0, 0, 8, 8), (8, 8), (-1, -1)) for i in range(3)]


def test_a_metadata_line_nested_too_deeply_names_the_shard_and_the_line() -> None:
    data = b'{"key": "a"}\n{"key": "b", "json": ' + _DEEP + b"}\n"
    meta = ShardMeta.from_bytes("shards/x.jsonl", data, 2, 8, 8)
    assert meta.rows(0, 1)[0][0] == "a"
    with pytest.raises(ShardFormatError, match=r"shards/x\.jsonl: line 2 \(sample 1\): JSON nested too deeply"):
        meta.rows(1, 2)
