"""A shard's metadata parsed by the line: a batch parses the lines it reads and no others, each line once;
a bad line is named (file, line, sample) when it is first read and does not stop the rows around it; a
line count that is not the manifest's fails at the shard's first touch. ``.jsonl`` bytes are generated
here (``ShardMeta.from_bytes``) or written with shardio's writer (``make_dataset``)."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from dataset_fixtures import indices, make_dataset

from shardio import ShardDataset, open_dataset
from shardio.errors import ShardFormatError, ShardIntegrityError
from shardio.read import shard_meta
from shardio.read.shard_meta import ShardMeta

HEIGHT, WIDTH = 6, 10
PATH = "ds/shards/input-0-00000.jsonl"
SAMPLES = 20


def record(i: int) -> dict[str, Any]:
    """Line ``i``: every field present on some lines, absent on others."""
    line: dict[str, Any] = {"key": f"k{i}"}
    if i % 2 == 0:
        line["cls"] = i
    if i % 3 == 0:
        line["txt"] = f"caption {i}\u2028second line"  # a U+2028 in a caption is no line break
    if i % 4 == 0:
        line["json"] = {"i": i}
    if i % 5 == 0:
        line["box"] = [1, 2, WIDTH - 1, HEIGHT]
    if i % 7 != 0:  # the source's upright size (a line written without it reads as -1)
        line["width"], line["height"] = 640 + i, 480 - i
    if i % 3 == 1:  # what the centre crop cut, (top, left) in source pixels
        line["crop"] = [i, 2 * i]
    return line


def encode(lines: list[bytes]) -> bytes:
    return b"".join(line + b"\n" for line in lines)


@pytest.fixture
def lines() -> list[bytes]:
    return [json.dumps(record(i), ensure_ascii=False).encode() for i in range(SAMPLES)]


def expected_row(i: int, missing_crop: tuple[int, int] = (-1, -1)) -> tuple[Any, ...]:
    line = record(i)
    return (line["key"], line.get("txt"), line.get("cls"), line.get("json"),
            line.get("box", (0, 0, WIDTH, HEIGHT)), (line.get("height", -1), line.get("width", -1)),
            line.get("crop", missing_crop))


@pytest.fixture
def json_loads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every text ``shard_meta`` hands to ``json.loads``, in order."""
    seen: list[str] = []
    real = json.loads

    def counting(text: str, *args: Any, **kwargs: Any) -> Any:
        seen.append(text)
        return real(text, *args, **kwargs)

    # shard_meta's own reference: the manifest, read with json.loads too, is not counted
    monkeypatch.setattr(shard_meta, "json", SimpleNamespace(loads=counting, JSONDecodeError=json.JSONDecodeError))
    return seen


# --- rows and columns -----------------------------------------------------------------------------------


def test_rows_are_the_lines_fields_with_defaults(lines: list[bytes]) -> None:
    meta = ShardMeta.from_bytes(PATH, encode(lines), SAMPLES, HEIGHT, WIDTH)
    assert len(meta) == SAMPLES
    assert [tuple(row) for row in meta.rows(3, 11)] == [expected_row(i) for i in range(3, 11)]
    assert meta.rows(18, 99) == meta.rows(18, 20) and meta.rows(5, 5) == []  # slice bounds


def test_whole_columns_are_every_row(lines: list[bytes]) -> None:
    meta = ShardMeta.from_bytes(PATH, encode(lines), SAMPLES, HEIGHT, WIDTH)
    assert meta.keys == [f"k{i}" for i in range(SAMPLES)]
    assert meta.txt == [record(i).get("txt") for i in range(SAMPLES)]
    assert meta.cls.dtype == np.int64 and meta.cls.tolist() == [i if i % 2 == 0 else -1 for i in range(SAMPLES)]
    assert meta.json == [record(i).get("json") for i in range(SAMPLES)]
    assert meta.box.dtype == np.int32 and meta.box.shape == (SAMPLES, 4)
    assert meta.box.tolist() == [list(expected_row(i)[4]) for i in range(SAMPLES)]
    assert meta.original_size.dtype == np.int64 and meta.original_size.shape == (SAMPLES, 2)
    assert meta.original_size.tolist() == [list(expected_row(i)[5]) for i in range(SAMPLES)]
    assert meta.crop_top_left.dtype == np.int64 and meta.crop_top_left.shape == (SAMPLES, 2)
    assert meta.crop_top_left.tolist() == [list(expected_row(i)[6]) for i in range(SAMPLES)]
    assert (meta.has_txt, meta.has_cls, meta.has_json) == (True, True, True)


@pytest.mark.parametrize("missing_crop", [(0, 0), (-1, -1)])
def test_a_line_without_crop_has_the_datasets_default(lines: list[bytes], missing_crop) -> None:
    # (0, 0) in a pad or stretch dataset (nothing is cut); (-1, -1), unknown, in a dataset of another mode
    # written before lines had a crop.
    meta = ShardMeta.from_bytes(PATH, encode(lines), SAMPLES, HEIGHT, WIDTH, missing_crop=missing_crop)
    rows = [tuple(row) for row in meta.rows(0, SAMPLES)]
    assert rows == [expected_row(i, missing_crop) for i in range(SAMPLES)]
    assert meta.crop_top_left[0].tolist() == list(missing_crop) and meta.crop_top_left[1].tolist() == [1, 2]


def test_a_last_line_without_newline_counts(lines: list[bytes]) -> None:
    meta = ShardMeta.from_bytes(PATH, encode(lines)[:-1], SAMPLES, HEIGHT, WIDTH)
    assert meta.rows(SAMPLES - 1, SAMPLES)[0][0] == f"k{SAMPLES - 1}"


def test_a_window_reads_its_rows_and_keeps_the_shards_flags(lines: list[bytes]) -> None:
    lines = [json.dumps({"key": f"k{i}", "cls": 7 if i == 0 else None}).encode() for i in range(SAMPLES)]
    window = ShardMeta.from_bytes(PATH, encode(lines), SAMPLES, HEIGHT, WIDTH).window(4, 9)
    assert len(window) == 5 and window.keys == [f"k{i}" for i in range(4, 9)]
    assert [row[0] for row in window.rows(1, 3)] == ["k5", "k6"]
    assert window.cls.tolist() == [-1] * 5 and window.has_cls  # line 0 has a label: the shard carries cls
    assert not window.has_txt and not window.has_json


# --- each line parsed once, only when read --------------------------------------------------------------


def test_rows_parse_only_their_lines_and_each_line_once(lines: list[bytes], json_loads: list[str]) -> None:
    meta = ShardMeta.from_bytes(PATH, encode(lines), SAMPLES, HEIGHT, WIDTH)
    assert json_loads == []  # counting the lines parses none
    meta.rows(7, 9)
    assert json_loads == [lines[7].decode(), lines[8].decode()]
    meta.rows(6, 10)
    meta.window(8, 12).rows(0, 2)  # lines 8 and 9, parsed already
    assert sorted(json_loads) == sorted(line.decode() for line in lines[6:10])
    assert len(meta.keys) == SAMPLES and meta.has_txt and len(meta.window(0, 3).txt) == 3
    assert sorted(json_loads) == sorted(line.decode() for line in lines)


def test_a_batch_parses_the_lines_it_reads_once(tmp_path, json_loads: list[str]) -> None:
    directory = str(tmp_path / "ds")
    make_dataset(directory, (40,))  # five shards of 8
    first = next(iter(ShardDataset(directory, 3, shuffle=False, prefetch=0)))
    assert indices(first).tolist() == [0, 1, 2]
    assert [json.loads(text)["key"] for text in json_loads] == ["s000000", "s000001", "s000002"]
    for _ in ShardDataset(directory, 3, shuffle=True, seed=1):
        pass
    keys = [json.loads(text)["key"] for text in json_loads]
    assert sorted(keys[3:]) == [f"s{i:06d}" for i in range(40)]  # a new dataset: its own snapshot


# --- bad lines and line counts --------------------------------------------------------------------------

BAD_LINES = {
    "not UTF-8": (b'{"key": "k\xff"}', r"not UTF-8 \(invalid start byte at byte \d+\)"),
    "invalid JSON": (b'{"key": "k1",', r"invalid JSON"),
    "not a record": (b'["k1"]', r"not a sample record \(a JSON object with a \"key\"\)"),
    "bad box": (b'{"key": "k1", "box": [0, 0, 11, 6]}', r"box \[0, 0, 11, 6\] is not \[x0, y0, x1, y1\] ints"),
    "crop outside the source": (b'{"key": "k1", "width": 50, "height": 40, "crop": [40, 0]}',
                                r"crop \[40, 0\] is not \[top, left\] ints with 0 <= top < height 40, "
                                r"0 <= left < width 50 \(the source's pixels\)"),
    "crop not two ints": (b'{"key": "k1", "crop": [1.5, 0]}', r"crop \[1.5, 0\] is not \[top, left\] ints"),
    "width not a size": (b'{"key": "k1", "width": "640", "height": 480}',
                         r"width '640' is not the source's size in pixels \(a positive integer\)"),
    "height zero": (b'{"key": "k1", "width": 640, "height": 0}',
                    r"height 0 is not the source's size in pixels"),
}


@pytest.mark.parametrize("kind", sorted(BAD_LINES))
def test_a_bad_line_is_named_when_read_and_the_rest_reads(lines: list[bytes], kind: str) -> None:
    bad, message = BAD_LINES[kind]
    lines[15] = bad
    meta = ShardMeta.from_bytes(PATH, encode(lines), SAMPLES, HEIGHT, WIDTH)
    assert [tuple(row) for row in meta.rows(0, 15)] == [expected_row(i) for i in range(15)]
    assert meta.rows(16, 20)[0][0] == "k16"
    for read in (lambda: meta.rows(14, 17), lambda: meta.keys, lambda: meta.has_cls,
                 lambda: meta.window(10, 20).rows(5, 6)):
        with pytest.raises(ShardFormatError, match=rf"^{PATH}: line 16 \(sample 15\): {message}.*"
                                                   r"HINT: run `preprocess verify DIR --repair`"):
            read()


def test_not_utf8_names_the_byte_in_the_file(lines: list[bytes]) -> None:
    lines[2] = b'{"key": "\xff"}'
    data = encode(lines)
    meta = ShardMeta.from_bytes(PATH, data, SAMPLES, HEIGHT, WIDTH)
    with pytest.raises(ShardFormatError, match=rf"at byte {data.index(0xFF)}\)"):
        meta.rows(2, 3)


@pytest.mark.parametrize("count", [SAMPLES - 1, SAMPLES + 1])
def test_a_line_count_that_is_not_the_manifests_fails_at_once(lines: list[bytes], count: int) -> None:
    data = encode(lines[:count] if count < SAMPLES else lines + [lines[0]])
    with pytest.raises(ShardIntegrityError, match=rf"^{PATH}: {count} lines, manifest says {SAMPLES} samples$"):
        ShardMeta.from_bytes(PATH, data, SAMPLES, HEIGHT, WIDTH)


@pytest.fixture
def dataset_dir(tmp_path) -> str:
    directory = str(tmp_path / "ds")
    make_dataset(directory, (16,))  # shards of 8: input-0-00000, input-0-00001
    return directory


def rewrite_line(directory: str, shard: str, line: int, replace: bytes) -> str:
    """Overwrite the start of ``line`` (0-based) of the shard's ``.jsonl`` in place (the size, checked at
    open, stays: only reading the line finds it)."""
    path = os.path.join(directory, "shards", f"{shard}.jsonl")
    with open(path, "rb") as f:
        data = bytearray(f.read())
    start = sum(len(x) + 1 for x in bytes(data).split(b"\n")[:line])
    data[start : start + len(replace)] = replace
    with open(path, "wb") as f:
        f.write(data)
    return path


def test_a_corrupt_line_far_from_a_batch_does_not_stop_it(dataset_dir: str) -> None:
    rewrite_line(dataset_dir, "input-0-00000", 7, b"#")
    batches = iter(ShardDataset(dataset_dir, 4, shuffle=False, prefetch=0))
    assert indices(next(batches)).tolist() == [0, 1, 2, 3]  # shard 0's first rows
    with pytest.raises(ShardFormatError, match=r"input-0-00000\.jsonl: line 8 \(sample 7\): invalid JSON"):
        next(batches)


def test_a_shard_whose_lines_are_not_its_samples_fails_at_its_first_touch(dataset_dir: str) -> None:
    path = rewrite_line(dataset_dir, "input-0-00001", 3, b"\n")  # one line more, the same size
    snapshot = open_dataset(dataset_dir)
    snapshot.meta(0)
    with pytest.raises(ShardIntegrityError, match=rf"^{path}: 9 lines, manifest says 8 samples$"):
        snapshot.meta(1)


def test_a_local_shard_keeps_only_its_line_ends_and_reads_lines_again_from_the_file(tmp_path, lines) -> None:
    path = tmp_path / "s.jsonl"
    path.write_bytes(encode(lines))
    meta = ShardMeta.from_file(str(path), str(path), encode(lines), len(lines), 6, 10)
    assert meta._lines.source[0] is None  # no bytes held: a shuffled batch touches hundreds of shards
    assert meta.rows(3, 5) == [expected_row(3), expected_row(4)]
    path.write_bytes(encode(lines)[:40])  # truncated while open: named, never a half-read row
    with pytest.raises(ShardIntegrityError, match=r"s\.jsonl: shorter than when it was opened"):
        meta.rows(len(lines) - 2, len(lines))
