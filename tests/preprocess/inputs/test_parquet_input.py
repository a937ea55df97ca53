"""Parquet inputs (Hugging Face and img2dataset layouts) give the samples the tar of the same images gives.

Each file is written here with pyarrow, in several row groups; the samples go through the same worker as
a tar's (``process_input``), so equal pixels and metadata prove that everything after the samples is shared.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from preprocess.config import JobConfig
from preprocess.inputs.kinds import KindReader, samples_of
from preprocess.inputs.resolve import resolve_inputs
from preprocess.inputs.parquet_samples import iter_parquet_samples
from preprocess.inputs.raw_sample import RawSample, SampleProblem
from preprocess.inputs.run_inputs import PathInputs
from preprocess.worker import process_input
from shardio.errors import InputError
from shardio.store.backends import for_path
from shardio.write.editable_index import EditableIndex
from tests.parquet_factory import (hf_table, img2dataset_table, with_non_utf8_column_name,
                                   write_parquet as write)
from tests.tar_factory import decode_index, index_image, jpeg_bytes, png_bytes, read_shards

CFG = JobConfig(height=16, width=16, samples_per_shard=4)
COUNT = 11  # against row groups of 4 and shards of 4: partial last ones of both


def run(path: str, out: str, cfg: JobConfig = CFG):
    result = process_input(path, out, cfg, for_path(path).stat_fingerprint(path))
    pixels, rows = read_shards(out, result.shards)
    return result, pixels, rows


def test_both_layouts_give_the_pixels_and_metadata_of_the_tar_of_the_same_images(tars, tmp_path):
    tar = tars.make("same.tar", range(COUNT))
    hf = write(tmp_path / "hf.parquet", hf_table(range(COUNT)))
    i2d = write(tmp_path / "i2d.parquet", img2dataset_table(range(COUNT)))
    assert pq.ParquetFile(hf).num_row_groups == 3
    _, tar_pixels, tar_rows = run(tar, str(tmp_path / "tar-out"))
    for path, layout in ((hf, "hf"), (i2d, "i2d")):
        result, pixels, rows = run(path, str(tmp_path / f"{layout}-out"))
        assert result.error is None and result.failures == [] and result.samples == COUNT
        assert [decode_index(p) for p in pixels] == list(range(COUNT)), "lost, duplicated or reordered rows"
        np.testing.assert_array_equal(pixels, tar_pixels)
        assert [r["txt"] for r in rows] == [r["txt"] for r in tar_rows]
        assert [r["member"] for r in rows] == [f"row {i}" for i in range(COUNT)]
        assert all(r["tar"] == path for r in rows)
        if layout == "hf":
            assert [r["key"] for r in rows] == [f"hf/{i}" for i in range(COUNT)]  # no key column: name/row
            assert [r["cls"] for r in rows] == [r["cls"] for r in tar_rows]
            assert [r["json"] for r in rows] == [r["json"] for r in tar_rows]  # {"index": i}
        else:
            assert [r["key"] for r in rows] == [r["key"] for r in tar_rows]
            assert rows[0]["cls"] is None
            assert rows[0]["json"] == {"status": "success", "error_message": None, "width": 320}
        assert os.path.basename(result.shards[0]["path"]).startswith(f"{layout}-"), "the stem drops .parquet"


def test_a_column_of_pngs_is_read(tmp_path):
    path = write(tmp_path / "png.parquet", hf_table(range(6), image=lambda i: png_bytes(index_image(i, 40, 30))))
    result, pixels, _ = run(path, str(tmp_path / "out"))
    assert result.failures == [] and [decode_index(p) for p in pixels] == list(range(6))


def test_rows_without_image_bytes_and_corrupt_cells_are_counted_reasons_naming_the_row(tmp_path):
    failed = {2, 7}
    table = img2dataset_table(range(COUNT), failed=failed)
    jpg = table.column("jpg").to_pylist()
    jpg[5] = b"\xff\xd8\xff\xe0 this is no JPEG"  # a corrupt cell
    jpg[9] = b""  # an empty one
    table = table.set_column(table.schema.get_field_index("jpg"), "jpg", pa.array(jpg, pa.binary()))
    path = write(tmp_path / "bad.parquet", table)
    result, pixels, rows = run(path, str(tmp_path / "out"))
    assert result.error is None
    assert [decode_index(p) for p in pixels] == [i for i in range(COUNT) if i not in {2, 5, 7, 9}]
    by_key = {f["key"]: f for f in result.failures}
    assert sorted(by_key) == ["000002", "000005", "000007", "000009"]
    assert all(f["input"] == path for f in result.failures)
    assert by_key["000002"]["code"] == "missing_image"
    assert by_key["000002"]["reason"] == ("row 2: no image bytes in column 'jpg' (status 'failed_to_download': "
                                          "HTTP Error 404: Not Found)")
    assert by_key["000005"]["reason"].startswith("row 5: ") and by_key["000005"]["code"] != "missing_image"
    assert by_key["000009"]["reason"] == "row 9: no image bytes in column 'jpg' (status 'success')"


def test_a_hf_image_with_only_a_path_and_a_null_cell_are_missing_images(tmp_path):
    table = hf_table(range(4))
    images = table.column("image").to_pylist()
    images[1] = {"bytes": None, "path": "/data/cat.jpg"}
    images[3] = None
    table = table.set_column(0, "image", pa.array(images, table.schema.field("image").type))
    found = list(iter_parquet_samples(write(tmp_path / "p.parquet", table), CFG))
    assert [type(s).__name__ for s in found] == ["RawSample", "SampleProblem", "RawSample", "SampleProblem"]
    assert found[1].reason == "row 1: no image bytes in column 'image' (only a path: '/data/cat.jpg')"


def test_columns_are_found_by_type_or_named_in_the_config(tmp_path):
    table = pa.table({"thumbnail": [b"x"] * 2, "photo": [jpeg_bytes(index_image(i)) for i in range(2)],
                      "labels_fine": pa.array([3, 4], pa.int32())})
    path = write(tmp_path / "two.parquet", table)
    with pytest.raises(Exception, match=r"two.parquet.*several binary columns \(thumbnail, photo\).*image_column"):
        list(iter_parquet_samples(path, CFG))
    named = JobConfig(height=16, width=16, image_column="photo", label_column="labels_fine")
    found = list(iter_parquet_samples(path, named))
    assert [s.image for s in found] == table.column("photo").to_pylist()
    assert [s.fields["cls"] for s in found] == [b"3", b"4"]
    none = write(tmp_path / "none.parquet", pa.table({"url": ["a"], "n": [1]}))
    with pytest.raises(Exception, match=r"none.parquet: no image column .*its columns: url \(string\), n \(int64\)"):
        list(iter_parquet_samples(none, CFG))
    with pytest.raises(Exception, match=r"no column 'picture' \(image_column\)"):
        list(iter_parquet_samples(path, JobConfig(height=16, width=16, image_column="picture")))


def test_a_file_that_is_not_parquet_or_is_cut_fails_as_an_input_naming_it(tmp_path):
    good = write(tmp_path / "good.parquet", hf_table(range(COUNT)))
    data = open(good, "rb").read()
    cut = tmp_path / "cut.parquet"
    cut.write_bytes(data[: len(data) // 2])
    text = tmp_path / "text.parquet"
    text.write_text("{}")
    for path in (cut, text):
        result = process_input(str(path), str(tmp_path / "out"), CFG, for_path(str(path)).stat_fingerprint(str(path)))
        assert result.error is not None and "not a readable Parquet file" in result.error, result.error
        assert result.lasting and result.shards == []
    assert os.listdir(tmp_path / "out" / "shards") == [] if (tmp_path / "out" / "shards").exists() else True


def test_a_footer_pyarrow_cannot_decode_is_an_unreadable_parquet_file_and_is_remembered(tmp_path):
    """A column name that is not UTF-8 makes pyarrow raise UnicodeDecodeError, not one of its own errors:
    still the file's failure, naming it, and lasting (the same bytes fail the same way: not read again)."""
    from preprocess import job
    from shardio.format.run_report import RunReport

    bad = with_non_utf8_column_name(tmp_path / "names.parquet", hf_table(range(COUNT)), "text")
    with pytest.raises(InputError) as caught:
        list(iter_parquet_samples(bad, CFG))
    assert str(caught.value).startswith(f"{bad}: not a readable Parquet file (UnicodeDecodeError: ")
    result = process_input(bad, str(tmp_path / "out"), CFG, (os.path.getsize(bad), 7))
    assert result.error.startswith("not a readable Parquet file (UnicodeDecodeError: ") and result.lasting
    assert result.shards == [] and result.samples == 0
    report = RunReport(run_id="r1", output="o", started="", config={})
    job._record(report, result)
    (entry,) = report.inputs_failed
    assert entry["input"] == bad and entry["failed_in"] == "r1"
    assert entry["fingerprint"] == {"size": os.path.getsize(bad), "mtime_ns": 7, "etag": ""}


def test_a_corrupt_row_group_fails_the_input_naming_the_rows(tmp_path):
    good = write(tmp_path / "g.parquet", hf_table(range(COUNT)))
    meta = pq.ParquetFile(good).metadata
    column = meta.row_group(1).column(0)  # the second row group's image bytes
    start = column.data_page_offset
    data = bytearray(open(good, "rb").read())
    data[start : start + 64] = bytes(64)  # the page header zeroed
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(bytes(data))
    found = []
    with pytest.raises(Exception) as caught:
        for item in iter_parquet_samples(str(bad), CFG):
            found.append(item)
    said = str(caught.value)
    assert str(bad) in said and "row group 1 (rows 4 to 7) cannot be read" in said, said
    assert len(found) == 4  # the first row group's rows came before (the job keeps none: all or nothing)
    result = process_input(str(bad), str(tmp_path / "out"), CFG, for_path(str(bad)).stat_fingerprint(str(bad)))
    assert "row group 1" in result.error and result.samples_lost == 4 and result.shards == []


def test_rows_stream_by_row_group_never_the_whole_file(tmp_path, monkeypatch):
    path = write(tmp_path / "big.parquet", hf_table(range(COUNT)), row_group_size=2)
    asked = []
    real = pq.ParquetFile.iter_batches

    def spy(self, *args, **kwargs):
        asked.append(kwargs.get("row_groups"))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(pq.ParquetFile, "iter_batches", spy)
    monkeypatch.setattr(pq.ParquetFile, "read", lambda *a, **k: pytest.fail("the whole file was read"))
    items = iter_parquet_samples(path, CFG)
    next(items)
    assert asked == [[0]], "more than the first row group read before the first sample"
    assert len(list(items)) == COUNT - 1 and asked == [[g] for g in range(6)]


def test_duplicate_keys_keep_the_first(tmp_path):
    table = img2dataset_table(range(3))
    table = table.set_column(0, "key", pa.array(["a", "b", "a"]))
    found = list(iter_parquet_samples(write(tmp_path / "d.parquet", table), CFG))
    assert isinstance(found[2], SampleProblem) and found[2].code.value == "duplicate_key"
    assert "row 2" in found[2].reason and isinstance(found[0], RawSample)


def test_a_glob_takes_parquet_where_it_says_so_and_a_name_without_suffix_by_its_magic(tmp_path):
    hf = write(tmp_path / "a.parquet", hf_table(range(2)))
    nameless = tmp_path / "part-0"
    os.link(hf, nameless)
    assert resolve_inputs([f"{tmp_path}/*.parquet"]).paths == [hf]
    assert resolve_inputs([str(nameless)]).paths == [str(nameless)]  # read: its first bytes are Parquet's
    found = list(samples_of(str(nameless), CFG, os.path.getsize(nameless)))
    assert [s.key for s in found] == ["part-0/0", "part-0/1"]
    assert json.loads(found[0].fields["json"]) == {"index": 0}


class RecordingObject:
    """An object store holding one object: records each ranged GET; ``etag`` is what a HEAD answers now."""

    is_local = False

    def __init__(self, data: bytes, etag: str = "etag-1") -> None:
        self.data, self.etag, self.ranges = data, etag, []

    def file_size(self, url: str) -> int:
        return len(self.data)

    def read_range(self, url: str, start: int, length: int) -> bytes:
        self.ranges.append((start, length))
        return self.data[start:start + length]

    def info(self, url: str):
        from types import SimpleNamespace

        return SimpleNamespace(path=url, size=len(self.data), mtime_ns=0, version=self.etag)


def test_an_object_is_read_by_ranges_and_a_replaced_one_is_not_committed(tmp_path, monkeypatch):
    from shardio.store import backends

    rows = 48  # ~170 KB in 12 row groups: well over pyarrow's 64 KB read of the footer
    local = write(tmp_path / "o.parquet", hf_table(range(rows)), row_group_size=4)
    data = open(local, "rb").read()
    store = RecordingObject(data)
    monkeypatch.setitem(backends._OPEN, "s3", store)
    url = "s3://bucket/in/o.parquet"
    out = tmp_path / "out"
    result = process_input(url, str(out), CFG, (len(data), 0, "etag-1"))
    assert result.error is None and result.samples == rows
    np.testing.assert_array_equal(read_shards(str(out), result.shards)[0], run(local, str(tmp_path / "l"))[1])
    assert max(length for _, length in store.ranges) < len(data) // 2, "the object was fetched whole"
    assert sum(length for _, length in store.ranges) < 2 * len(data)
    store.etag = "etag-2"  # replaced since the LIST that found it
    again = process_input(url, str(tmp_path / "out2"), CFG, (len(data), 0, "etag-1"))
    assert "replaced while it was read" in again.error and again.shards == [] and not again.lasting


def test_a_parquet_file_in_a_bucket_gives_the_local_pixels(s3_server, s3_bucket, tmp_path):
    local = write(tmp_path / "b.parquet", img2dataset_table(range(COUNT), failed={3}))
    s3_server.client().upload_file(local, s3_bucket, "in/b.parquet")
    resolved = resolve_inputs([f"s3://{s3_bucket}/in/*.parquet"])
    [url] = resolved.paths
    result = process_input(url, str(tmp_path / "remote"), CFG, resolved.listed[url])
    assert result.error is None and [f["key"] for f in result.failures] == ["000003"]
    expected = run(local, str(tmp_path / "local"))[1]
    np.testing.assert_array_equal(read_shards(str(tmp_path / "remote"), result.shards)[0], expected)


def test_diagnose_times_a_parquet_file_and_a_folder_as_it_times_a_tar(tmp_path):
    from preprocess.diagnose import diagnose
    from tests.folder_factory import flat_folder

    parquet = write(tmp_path / "d.parquet", img2dataset_table(range(6), failed={2}))
    folder = flat_folder(tmp_path / "photos", range(4))
    result = diagnose([parquet, folder], CFG, limit=100, write_dir=str(tmp_path))
    assert result["inputs_failed"] == [] and result["samples"] == 9, result["inputs_failed"]


def test_hugging_face_class_names_travel_in_json(tmp_path):
    table = hf_table(range(3)).drop_columns(["index"])
    table = table.set_column(2, "label", pa.array([1, -1, 0], pa.int64()))
    features = {"image": {"_type": "Image"}, "text": {"_type": "Value"},
                "label": {"_type": "ClassLabel", "names": ["cat", "dog"]}}
    table = table.replace_schema_metadata({b"huggingface": json.dumps({"info": {"features": features}}).encode()})
    found = list(iter_parquet_samples(write(tmp_path / "hf.parquet", table), CFG))
    assert [s.fields.get("cls") for s in found] == [b"1", None, b"0"]  # -1: no label
    assert [json.loads(s.fields["json"]) if "json" in s.fields else None for s in found] == [
        {"class": "dog"}, None, {"class": "cat"}]


def test_the_kind_the_resolution_read_is_told_to_the_task_not_read_again(tmp_path, monkeypatch):
    nameless = tmp_path / "part-0"
    os.link(write(tmp_path / "a.parquet", hf_table(range(2))), nameless)
    resolved = resolve_inputs([str(nameless)])
    assert resolved.kinds == {str(nameless): "parquet"}  # its first bytes, read once by the resolution
    reader = PathInputs(resolved).reader(EditableIndex.of(None, (8, 8, 3), {}, {}), [])
    assert isinstance(reader, KindReader)

    def no_head(*args, **kwargs):
        raise AssertionError("the task read the input's first bytes again")

    monkeypatch.setattr("preprocess.inputs.kinds.input_kind", no_head)
    found = list(reader(str(nameless), CFG, os.path.getsize(nameless), ""))
    assert [s.key for s in found] == ["part-0/0", "part-0/1"]
